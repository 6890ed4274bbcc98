"""`headrace learner` and `headrace actor` from separate processes, as docs/cluster.md runs them
from three shells: a learner (embedded Redis on a fixed port, two buffer shards) and two actors
that join it by URL and the password in $HEADRACE_REDIS_PASSWORD, train guess_number, with the
weights in the buffer's Redis (`weights.backend: redis`: no shared filesystem). Midway the
whole fleet dies (SIGKILL of the learner's process group, its Redis included, and of both actors,
as a preempted allocation would): `headrace learner --resume RUN_DIR` and two fresh actors finish
the run from its checkpoint. The actors stop by themselves when the run ends; the password shows
up in no output, argv or run file; the accounting identity holds exactly over both shards and
both learner starts."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from headrace.benchlib import LEARNED_SUCCESS_N8
from headrace.buffer.redis_stream import RedisBuffer
from headrace.buffer.server import RedisServer
from headrace.buffer.sharded import shard_of
from headrace.runtime.accounting import accounting, identity

SMALL = [
    "--set", "env.kwargs.n=8", "--set", "env.kwargs.max_turns=3",
    "--set", "run.max_steps=150", "--set", "run.max_wall_s=0", "--set", "run.stop_at_target=false",
    "--set", "run.eval_every=50", "--set", "learner.groups_per_batch=16",
    "--set", "learner.minibatches=1", "--set", "learner.optimizer.lr=3e-3",
    "--set", "actor.envs_per_actor=64", "--set", "actor.max_batch=64",
    "--set", "buffer.capacity=16", "--set", "buffer.shards=2", "--set", "run.ledger=true",
    "--set", "buffer.fsync=always", "--set", "run.checkpoint_every=10",
    "--set", "weights.backend=redis",  # nothing shared but the buffer's server
]
KILL_AFTER = 30  # learner steps before the fleet is killed (3 checkpoints)
CLI = [sys.executable, "-m", "headrace.cli"]
CONFIG = "examples/guess_number.yaml"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(process: subprocess.Popen) -> None:
    """Kills what is left of `process` (its whole group: each starts a session of its own)."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.communicate(timeout=30)


def _step(run_dir: pathlib.Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return int(json.loads(lines[-1]).get("learner/step", 0)) if lines else 0
    except (OSError, ValueError):
        return 0  # not written yet, or a line being written


@pytest.mark.timeout(1200)  # 300 s to the kill, then a resume of up to 420 s
def test_a_learner_and_two_actor_processes_train_guess_number_through_a_fleet_crash(tmp_path):
    password = "pw-" + os.urandom(8).hex()
    env = {**os.environ, "HEADRACE_REDIS_PASSWORD": password}
    port = _free_port()
    url = f"redis://headrace@127.0.0.1:{port}/0"
    run_dir = pathlib.Path(tmp_path) / "run"
    names = ["actor-a", "actor-c"]
    assert {shard_of(n, 2) for n in names} == {0, 1}  # one actor per shard

    def actors() -> list[subprocess.Popen]:  # started at once: they wait for the announcement
        return [subprocess.Popen([*CLI, "actor", CONFIG, "--connect", url, "--name", name,
                                  *SMALL], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env, start_new_session=True)
                for name in names]

    # 1. The fleet trains, then dies whole once checkpoints exist.
    first = subprocess.Popen(
        [*CLI, "learner", CONFIG, "--json", "--set", f"run.dir={run_dir}",
         "--set", f"buffer.port={port}", *SMALL],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True)
    fleet = actors()
    try:
        deadline = time.monotonic() + 300
        while _step(run_dir) < KILL_AFTER:
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, f"step {_step(run_dir)} after 300 s"
            time.sleep(0.2)
        for process in (first, *fleet):
            os.killpg(process.pid, signal.SIGKILL)  # each whole process group
        first_err = first.communicate(timeout=30)[1]
        fleet_outputs = [a.communicate(timeout=30) for a in fleet]
    finally:
        for process in (first, *fleet):
            _stop(process)

    # 2. One command resumes the learner side; two fresh actors join it by the same URL.
    learner = subprocess.Popen([*CLI, "learner", "--resume", str(run_dir), "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env, start_new_session=True)
    fleet = actors()
    try:
        out, err = learner.communicate(timeout=420)
        assert learner.returncode == 0, err[-3000:]
        actor_outputs = [a.communicate(timeout=60) for a in fleet]  # they stop on their own
        for actor, (_, actor_err) in zip(fleet, actor_outputs):
            assert actor.returncode == 0, actor_err[-3000:]
            assert "ended; stopping" in actor_err
    finally:
        for process in (learner, *fleet):
            _stop(process)
    actor_outputs += fleet_outputs
    summary = json.loads(out)
    assert summary["steps"] == 150 and summary["errors"] == []
    # It learned through the crash, though this run loses the steps after its last checkpoint and
    # the episodes in flight at the kill, with two actors and two shards interleaving differently
    # each time.
    assert summary["final_success_rate"] >= LEARNED_SUCCESS_N8, summary
    assert f"--connect {url}" in err  # the learner says how to join, without the password
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert not (run_dir / "weights").exists()  # every version went through Redis
    assert record["actor/weights_version"] >= 100, record  # and reached the actors
    assert record["buffer/written_shard0"] > 0 and record["buffer/written_shard1"] > 0, record
    texts = [out, err, first_err, *(o + e for o, e in actor_outputs)]
    texts += [p.read_text(errors="replace") for p in run_dir.rglob("*")
              if p.is_file() and p.name != "secrets.json" and p.suffix in
              (".json", ".jsonl", ".yaml", ".conf", ".log", "")]
    assert not any(password in t for t in texts)

    # The accounting identity, exactly, by group id, over both shards (the run's own Redis
    # restarted from its append-only file).
    with RedisServer(run_dir / "redis") as server:
        client = server.client()
        try:
            result = accounting(run_dir, client)
            per_shard = [RedisBuffer(client, run_id=result["run_id"], consumer="check", shard=i,
                                     ledger=False).written_group_ids() for i in range(2)]
        finally:
            client.close()
    counts = identity(result)
    assert result["learner_starts"] == 2 and len(json.loads(
        (run_dir / "run.json").read_text())["resumes"]) == 1
    assert counts["identity_exact"] and counts["lost"] == 0 == counts["trained_twice"], counts
    assert len(result["written"]) == result["added"] == counts["written"] > 0
    assert all(per_shard) and not per_shard[0] & per_shard[1]  # both shards, disjoint
    assert per_shard[0] | per_shard[1] == result["written"]


@pytest.mark.timeout(120)
def test_an_actor_without_a_learner_gives_up_with_one_clear_line(redis_server_factory):
    server = redis_server_factory().start()  # its own: no other test's learner announced there
    result = subprocess.run([*CLI, "actor", CONFIG, "--connect", server.url, "--wait", "1",
                             "--name", "lonely"], capture_output=True, text=True, timeout=100)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "no headrace learner announced a run" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("argv, message", [
    (["actor", CONFIG], "needs the buffer's address"),
    (["actor", CONFIG, "--connect", "redis://:secret@127.0.0.1:1/0"], "carries a password"),
    (["learner", CONFIG], "HEADRACE_REDIS_PASSWORD"),
    (["actor", CONFIG, "--connect", "redis://127.0.0.1:1/0", "--name", "a b"], "--name 'a b'"),
])
def test_standalone_mistakes_are_one_line(argv, message):
    env = {k: v for k, v in os.environ.items() if k != "HEADRACE_REDIS_PASSWORD"}
    result = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr
    assert "secret" not in result.stderr
