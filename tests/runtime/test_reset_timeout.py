"""`env.reset_timeout_s`: a reset that hangs ends its episode (status error, `env/timeouts`), and
the environment is discarded (`env/discarded`) instead of being used again while its thread may
still be running; the actor goes on producing groups with fresh environments."""

import threading
import time

import pytest

from headrace.buffer.memory import MemoryBuffer
from headrace.config import ConfigError, load
from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.runtime import build
from headrace.types import STATUS_ERROR, STATUS_OK
from headrace.weights.memory import MemoryWeightStore
from tests.runtime.hanging_env import HangingResetEnv


@pytest.mark.timeout(120)
def test_a_hanging_reset_times_out_and_its_environment_is_discarded():
    config = load(data={
        "run": {"launcher": "threads"},
        # 2 s: a trivial reset (on a worker thread) must not outlast it on a loaded machine, or
        # a third timeout spoils the exact counts below; the hung ones wait 120 s regardless.
        "env": {"name": "tests.runtime.hanging_env:HangingResetEnv", "reset_timeout_s": 2.0},
        "actor": {"envs_per_actor": 4, "group_size": 2, "max_batch": 8},
        "sampling": {"max_new_tokens": 1}, "shapes": {"buckets": [8]}, "model": {"max_len": 8}})
    task = build.build_task(config)
    graphdef, params = build.init_params(config, task)
    HangingResetEnv.to_hang = 2  # the actor's first two: its first slot's
    weights = MemoryWeightStore(2)
    weights.publish(params_lib.to_host(params), 0)
    buffer = MemoryBuffer(capacity=1000)
    metrics, stop = Metrics(), threading.Event()
    actor = build.make_actor(config, task, "a0",
                             build.make_sampler(config, task, graphdef, seed=0, acting=True),
                             buffer, weights, metrics, stop)
    thread = threading.Thread(target=actor.run)
    thread.start()
    try:
        deadline = time.monotonic() + 90
        while (metrics.snapshot().get("env/discarded", 0) < 2 or not any(
                len(t.calls) > 1 for t in HangingResetEnv.instances[-2:])
                or buffer.depth() < 6) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the replacements have played and six groups are in
    finally:
        stop.set()
        thread.join(timeout=30)
        HangingResetEnv.release.set()  # the abandoned resets return: their threads end
    assert not thread.is_alive()
    groups = [e.group for e in buffer.get(100_000, timeout_s=1)]
    assert len(groups) >= 6, "the actor stopped producing groups"
    statuses = [[t.status for t in g.trajectories] for g in groups]
    timed_out = [g for g, s in zip(groups, statuses) if s == [STATUS_ERROR] * 2]
    assert len(timed_out) == 1, statuses  # the hung slot's first group, nothing else
    exceeded = f"environment reset exceeded {config.env.reset_timeout_s} s"  # 2.0 s
    assert all(exceeded in t.error for t in timed_out[0].trajectories)
    assert sum(s == [STATUS_OK] * 2 for s in statuses) == len(groups) - 1
    snapshot = metrics.snapshot()
    assert snapshot["env/timeouts"] == 2 and snapshot["env/discarded"] == 2
    # The hung environments were never called again; none saw two calls at once; two fresh
    # ones replaced them and played.
    hung = [env for env in HangingResetEnv.instances if env.hangs]
    assert [env.calls for env in hung] == [["reset"], ["reset"]]
    assert not HangingResetEnv.overlaps, HangingResetEnv.overlaps
    assert len(HangingResetEnv.instances) >= 1 + 4 + 2  # the probe, the pool, the replacements

def test_the_reset_timeout_is_validated():
    with pytest.raises(ConfigError, match="env.reset_timeout_s"):
        load(data={"env": {"reset_timeout_s": 0}})
