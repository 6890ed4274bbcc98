"""Crash safety end to end: SIGKILL a whole `headrace train` process tree, `--resume` it, and check
the accounting identity exactly (real redis-server, real processes, the real command line).

written = trained ∪ dropped (by reason) ∪ quarantined ∪ still in the buffer, with nothing missing,
nothing trained twice, and the redelivered entries counted (`headrace.runtime.accounting.accounting`).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import redis

from headrace.buffer.server import SECRETS_FILE, RedisServer, RedisServerError, find_redis_server
from headrace.rundir import RunDir
from headrace.runtime.accounting import accounting

CHECKPOINT_EVERY = 3
MORE_STEPS = 6  # trained by the resumed run after its checkpoint
SMALL = [
    "--set", "run.launcher=processes", "--set", "buffer.fsync=always", "--set", "run.ledger=true",
    "--set", f"run.checkpoint_every={CHECKPOINT_EVERY}", "--set", "run.max_wall_s=0",
    "--set", "run.stop_at_target=false", "--set", "run.eval_every=0",
    "--set", "env.kwargs.n=8", "--set", "env.kwargs.max_turns=3",
    "--set", "learner.groups_per_batch=4", "--set", "learner.minibatches=1",
    "--set", "actor.group_size=4", "--set", "actor.envs_per_actor=32",
    "--set", "actor.max_batch=32", "--set", "buffer.capacity=8",
]


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _members(pgid: int) -> set[int]:
    """Live (non-zombie) processes of process group `pgid`."""
    found = set()
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit() and _group_of(int(entry.name)) == pgid:
            try:
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                found.add(int(entry.name))
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return f"{pid} (gone)"


def _redis_pids(run_dir: pathlib.Path) -> set[int]:
    """The live redis-server serving RUN_DIR/redis: the pid its pid file names, if that process
    is a redis-server on the port of RUN_DIR/redis/redis.conf (the server rewrites its command
    line to `redis-server HOST:PORT`, and a pid file can outlive its process: pids are reused)."""
    try:
        pid = int((run_dir / RunDir.REDIS / "redis.pid").read_text().strip())
        port = next(int(line.split()[1]) for line in
                    (run_dir / RunDir.REDIS / "redis.conf").read_text().splitlines()
                    if line.startswith("port "))
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError, StopIteration):
        return set()
    ours = b"redis-server" in cmdline and f":{port}\0".encode() in cmdline
    return _alive({pid}) if ours else set()


def _checkpoints(run_dir: pathlib.Path) -> list[int]:
    directory = run_dir / RunDir.CHECKPOINTS
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) \
        if directory.exists() else []


def _pending(run_dir: pathlib.Path) -> int:
    """Delivered, unacknowledged entries in the live run's Redis (0 when unreachable)."""
    try:
        port = next(int(line.split()[1]) for line in
                    (run_dir / RunDir.REDIS / "redis.conf").read_text().splitlines()
                    if line.startswith("port "))
        run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
        admin = json.loads((run_dir / SECRETS_FILE).read_text())["admin"]  # the run's password
        client = redis.Redis(port=port, password=admin, socket_timeout=2)
        try:
            return int(client.xpending(f"headrace:{{{run_id}:0}}:groups", "learners")["pending"])
        finally:
            client.close()
    except (OSError, StopIteration, KeyError, ValueError, redis.RedisError):
        return 0


def _kill_everything(process: subprocess.Popen, run_dir: pathlib.Path) -> None:
    """Cleanup after a failure: nothing of this test may outlive it. The group is signalled only
    while its leader is not reaped: a reaped pid (and group id) may already be another's."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in _redis_pids(run_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _alive(pids)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("processes", [1, 2])
def test_sigkill_then_resume_keeps_the_accounting_identity_exactly(tmp_path, processes):
    """One learner process, or two (jax.distributed, 2 simulated devices each) whose
    checkpoints and ledgers cover the job together."""
    try:
        find_redis_server()
    except RedisServerError as error:
        pytest.skip(str(error))
    run_dir = tmp_path / "run"
    base = [sys.executable, "-m", "headrace.cli", "train"]
    log = open(tmp_path / "train.log", "w")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    layout = ["--set", f"parallel.processes={processes}",
              "--set", "parallel.mesh={data: -1}"] if processes > 1 else []

    # 1. A run that would go on for long, killed once a few checkpoints exist.
    first = subprocess.Popen(
        [*base, "examples/guess_number.yaml", "--json", "--no-live",
         "--set", f"run.dir={run_dir}", *SMALL, *layout, "--set", "run.max_steps=100000"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 300  # start-up, compiles, 6 steps: a loaded machine
        while len(_checkpoints(run_dir)) < 2 or _pending(run_dir) == 0:
            assert first.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoints within 300 s"
            time.sleep(0.2)
        tree = _members(first.pid) | _redis_pids(run_dir)
        assert len(tree) >= 3 + processes, tree  # supervisor, learners, actor, redis-server
        os.killpg(first.pid, signal.SIGKILL)  # the supervisor's whole process group
        first.wait(10)
        survivors = _wait_gone(tree, 15)  # redis-server (own session) dies with its parent
        assert not survivors, f"processes outlived the SIGKILL: {survivors}"
    finally:
        _kill_everything(first, run_dir)
        first.wait(10)
    killed_at = max(_checkpoints(run_dir))

    # 2. Resume to completion.
    target = killed_at + MORE_STEPS
    second = subprocess.Popen(
        [*base, "--resume", str(run_dir), "--json", "--set", f"run.max_steps={target}"],
        stdout=subprocess.PIPE, stderr=log, start_new_session=True, env=env)
    try:
        out, _ = second.communicate(timeout=400)
        # Nothing is left behind (the resource tracker takes a moment to see its pipe close).
        left = _wait_gone(_members(second.pid) | _redis_pids(run_dir), 10)
    finally:
        _kill_everything(second, run_dir)
        second.wait(10)
    log.close()
    assert second.returncode == 0, (tmp_path / "train.log").read_text()[-3000:]
    summary = json.loads(out)
    assert summary["steps"] == target and summary["stopped_by"] == "max_steps", summary
    assert not left, [_cmdline(pid) for pid in left]
    record = json.loads((run_dir / "run.json").read_text())
    assert len(record["resumes"]) == 1
    lines = (run_dir / RunDir.METRICS).read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps[0] < killed_at <= steps[-1] == target  # appended to, not replaced
    # The resumed run's lines start from its checkpoint, never from the step the killed learner
    # had reached and the crash undid (its last metrics, left in the server, are cleared).
    resumed = [json.loads(line) for line in lines]
    resumed = [r.get("learner/step", 0) for r in resumed
               if r["time"] >= record["resumes"][0]["time"]]
    assert resumed and resumed == sorted(resumed) and resumed[-1] == target, resumed

    # 3. The accounting identity, by id, on the run's own Redis restarted from its append-only file.
    with RedisServer(run_dir / RunDir.REDIS) as server:
        client = server.client()
        try:
            result = accounting(run_dir, client)
        finally:
            client.close()
    assert result["learner_starts"] == 2
    assert len(result["written"]) == result["added"] > 0  # every put recorded
    assert not result["missing"], f"lost: {sorted(result['missing'])[:10]}"
    assert not result["trained_twice"], sorted(result["trained_twice"])[:10]
    assert not result["unrecorded"]
    handled = result["trained"].union(*result["dropped_by_reason"].values())
    assert result["written"] == handled | result["quarantined"] | result["in_buffer"]
    assert len(result["trained"]) == target * 4  # groups_per_batch groups per step, none twice
    assert result["redelivered"], "pending entries of the killed learner were not redelivered"
    counters = result["checkpoint"]["counters"]
    assert counters.get("buffer/redelivered_trained", 0) \
        + counters.get("buffer/redelivered_skipped", 0) > 0
    assert not result["counter_mismatches"], result["counter_mismatches"]
    assert result["checkpoint"]["learner_step"] == target


def test_resume_and_fresh_runs_refuse_the_wrong_folder(tmp_path, capsys):
    from headrace.cli import main

    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "not a resumable run folder" in capsys.readouterr().err
    assert main(["train", "examples/guess_number.yaml", "--resume", str(tmp_path)]) == 2
    assert "not both" in capsys.readouterr().err
    for command in ("train", "learner"):
        assert main([command]) == 2
        assert f"{command} needs a CONFIG file" in capsys.readouterr().err
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"run_id": "abc", "ledger": False}))
    (run_dir / RunDir.CONFIG).write_text("run: {launcher: processes}\n")
    assert main(["train", "examples/guess_number.yaml", "--set", f"run.dir={run_dir}",
                 "--set", "run.launcher=processes"]) == 2  # a fresh run must not overwrite it
    assert "already holds a run" in capsys.readouterr().err
    assert main(["train", "--resume", str(run_dir), "--set", "run.ledger=true"]) == 2
    assert "cannot change" in capsys.readouterr().err
    assert not list(run_dir.glob("redis"))  # nothing was started
