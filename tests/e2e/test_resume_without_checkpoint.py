"""`--resume` of a run that has no checkpoint but whose acknowledged data is gone is refused with a
clear error (it used to start again from fresh weights, exit 0, and say nothing)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from headrace.buffer.server import RedisServerError, find_redis_server
from tests.e2e.test_crash import _kill_everything, _members, _redis_pids, _wait_gone

SMALL = [
    "--set", "run.launcher=processes", "--set", "run.checkpoint_every=0",
    "--set", "run.max_wall_s=0", "--set", "run.stop_at_target=false", "--set", "run.eval_every=0",
    "--set", "run.log_every=1", "--set", "run.max_steps=100000",
    "--set", "env.kwargs.n=8", "--set", "env.kwargs.max_turns=3",
    "--set", "learner.groups_per_batch=4", "--set", "learner.minibatches=1",
    "--set", "actor.group_size=4", "--set", "actor.envs_per_actor=32",
    "--set", "actor.max_batch=32", "--set", "buffer.capacity=8",
]


def _steps(run_dir) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.timeout(240)
def test_resume_without_a_checkpoint_after_acknowledgements_is_refused(tmp_path):
    try:
        find_redis_server()
    except RedisServerError as error:
        pytest.skip(str(error))
    run_dir = tmp_path / "run"
    log = open(tmp_path / "train.log", "w")
    first = subprocess.Popen(
        [sys.executable, "-m", "headrace.cli", "train", "examples/guess_number.yaml", "--json",
         "--no-live", "--set", f"run.dir={run_dir}", *SMALL],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while _steps(run_dir) < 3:
            assert first.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no training within 150 s"
            time.sleep(0.2)
        tree = _members(first.pid) | _redis_pids(run_dir)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        assert not _wait_gone(tree, 15)
    finally:
        _kill_everything(first, run_dir)
        first.wait(10)
        log.close()
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    record = (run_dir / "run.json").read_text()

    second = subprocess.run(
        [sys.executable, "-m", "headrace.cli", "train", "--resume", str(run_dir), "--json",
         "--set", "run.max_steps=5"], capture_output=True, text=True, timeout=120)
    assert second.returncode == 2, second.stderr[-3000:]
    assert "Traceback" not in second.stderr and second.stdout == ""
    assert "no checkpoint" in second.stderr and "acknowledged" in second.stderr
    assert "run.checkpoint_every" in second.stderr
    assert (run_dir / "run.json").read_text() == record  # the refused resume left no trace
    assert not _redis_pids(run_dir)  # the server it started to look is stopped
