"""Two learner hosts under `run.launcher: ray` (`parallel.processes: 2`, one Ray actor each,
`jax.distributed` with host 0's coordinator address over Gloo), through the real command line on a
local Ray the run starts itself: the run reaches its step limit, both processes write their part
of every checkpoint, and `headrace train --resume RUN_DIR` continues it on Ray with both hosts
again; the accounting identity then holds exactly from the ledger, over both learner starts."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from headrace.buffer.server import RedisServerError, find_redis_server
from headrace.runtime.accounting import stopped_run_identity

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "headrace.cli", "train"]
FIRST, MORE = 8, 4  # learner steps of the first run, and of the resumed one
SMALL = [
    "--set", "run.launcher=ray", "--set", "parallel.processes=2",
    "--set", "parallel.mesh={data: -1}", "--set", "run.ray_learner_bundle={CPU: 0.5}",
    "--set", "run.ray_actor_bundle={CPU: 0.5}", "--set", "weights.backend=redis",
    "--set", "buffer.fsync=always", "--set", "run.ledger=true", "--set", "run.checkpoint_every=4",
    "--set", "run.max_wall_s=0", "--set", "run.stop_at_target=false", "--set", "run.eval_every=0",
    "--set", "env.kwargs.n=8", "--set", "env.kwargs.max_turns=3",
    "--set", "learner.groups_per_batch=4", "--set", "learner.minibatches=1",
    "--set", "actor.num_actors=1", "--set", "actor.envs_per_actor=16",
    "--set", "actor.max_batch=16", "--set", "buffer.capacity=8",
]


@pytest.mark.xdist_group("ray")  # one Ray cluster at a time: each wants both cores
@pytest.mark.slow  # two Ray starts and two jax.distributed jobs: ~1-2 min idle
@pytest.mark.timeout(600)
def test_two_learner_hosts_train_and_resume_on_ray(tmp_path):
    pytest.importorskip("ray")
    try:
        find_redis_server()
    except RedisServerError as error:
        pytest.skip(str(error))
    run_dir = tmp_path / "run"
    # Two simulated devices per process; Ray's own local instance, no stranger's.
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    runs = [[*CLI, "examples/guess_number.yaml", "--json", "--no-live",
             "--set", f"run.dir={run_dir}", *SMALL, "--set", f"run.max_steps={FIRST}"],
            [*CLI, "--resume", str(run_dir), "--json", "--no-live",
             "--set", f"run.max_steps={FIRST + MORE}"]]
    for argv, steps in zip(runs, (FIRST, FIRST + MORE)):
        result = subprocess.run(argv, capture_output=True, text=True, timeout=280, cwd=ROOT,
                                env=env)
        assert result.returncode == 0, result.stderr[-4000:]
        summary = json.loads(result.stdout)  # stdout is exactly one JSON object
        assert summary["steps"] == steps and summary["errors"] == [], summary
        checkpoint = run_dir / "checkpoints" / str(steps) / "state"
        written = sorted(p.name for p in checkpoint.glob("ocdbt.process_*"))
        assert written == ["ocdbt.process_0", "ocdbt.process_1"], written  # both hosts
    assert len(json.loads((run_dir / "run.json").read_text())["resumes"]) == 1
    counts = stopped_run_identity(run_dir)
    assert counts["identity_exact"] and counts["lost"] == 0 == counts["trained_twice"], counts
    assert counts["trained"] == (FIRST + MORE) * 4  # every step's groups, each trained once
