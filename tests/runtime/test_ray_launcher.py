"""The Ray launcher's refusal of a placement group the cluster cannot hold: a LaunchError naming
the bundles and the cluster's resources, with the run's embedded Redis and the group cleaned up;
and the same for the buffer's own bundle (`run.ray_buffer_bundle`), refused before any server
starts (a local one-node Ray, started and stopped here)."""

from __future__ import annotations

import pathlib

import pytest
import redis

from headrace.buffer.server import RedisServerError, find_redis_server
from headrace.config import load

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.xdist_group("ray")  # one Ray cluster at a time: each wants both cores
@pytest.mark.timeout(240)
def test_an_unplaceable_bundle_is_refused_and_cleaned_up(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    try:
        find_redis_server()
    except RedisServerError as error:
        pytest.skip(str(error))
    from headrace.runtime import ray_buffer, ray_launcher
    from headrace.runtime.processes import LaunchError

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setattr(ray_launcher, "READY_TIMEOUT_S", 3.0)
    monkeypatch.setattr(ray_buffer, "READY_TIMEOUT_S", 3.0)
    run_dir = tmp_path / "run"
    small = ["run.launcher=ray", "run.max_steps=1", "actor.num_actors=1",
             "actor.envs_per_actor=8", "actor.max_batch=8", "learner.groups_per_batch=1",
             "learner.minibatches=1", "buffer.capacity=4", "buffer.max_pending=64"]
    config = load(ROOT / "examples" / "guess_number.yaml", [
        *small, f"run.dir={run_dir}", "run.ray_actor_bundle={CPU: 1, no_such_node: 1}"])
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        with pytest.raises(LaunchError) as error:
            ray_launcher.train(config, live=False)
        message = str(error.value)
        assert "could not reserve" in message and "no_such_node" in message
        assert "'CPU': 2.0" in message  # what the cluster has
        groups = ray.util.placement_group_table().values()
        assert all(g["state"] == "REMOVED" for g in groups), groups

        other = tmp_path / "other"
        config = load(ROOT / "examples" / "guess_number.yaml", [
            *small, f"run.dir={other}", "run.ray_buffer_bundle={CPU: 1, no_buffer_node: 1}"])
        with pytest.raises(LaunchError) as error:
            ray_launcher.train(config, live=False)
        message = str(error.value)
        assert "buffer's bundle" in message and "no_buffer_node" in message
        assert "run.ray_buffer_bundle" in message
        groups = ray.util.placement_group_table().values()
        assert all(g["state"] == "REMOVED" for g in groups), groups
        assert not (other / "redis" / "redis.conf").exists()  # no server was started
    finally:
        ray.shutdown()
    port = next(int(line.split()[1]) for line in
                (run_dir / "redis" / "redis.conf").read_text().splitlines()
                if line.startswith("port "))
    with pytest.raises(redis.ConnectionError):  # the run's server was stopped
        redis.Redis(port=port, socket_connect_timeout=2).ping()
