"""Tiny end-to-end runs through the real command line: the system learns, and says so in JSON."""

import json
import os
import subprocess
import sys

import pytest

from headrace.benchlib import LEARNED_SUCCESS_N8

SMALL = [
    "--set", "env.kwargs.n=8", "--set", "env.kwargs.max_turns=3",
    "--set", "run.max_steps=150", "--set", "run.max_wall_s=0", "--set", "run.stop_at_target=false",
    "--set", "run.eval_every=50", "--set", "learner.groups_per_batch=16",
    "--set", "learner.minibatches=1", "--set", "learner.optimizer.lr=3e-3",
    "--set", "actor.envs_per_actor=128", "--set", "actor.max_batch=128",
    "--set", "buffer.capacity=16",
]


@pytest.mark.timeout(600)
def test_train_learns_guess_number_and_prints_one_json_object(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "headrace.cli", "train", "examples/guess_number.yaml", "--json",
         "--set", f"run.dir={tmp_path}/run", *SMALL],
        capture_output=True, text=True, timeout=580)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)  # stdout is exactly one JSON object
    for key in ("final_success_rate", "time_to_target_s", "learner_utilization", "steps",
                "episodes", "wall_s"):
        assert key in summary
    assert summary["steps"] == 150
    assert summary["final_success_rate"] >= LEARNED_SUCCESS_N8, summary
    run_dir = tmp_path / "run"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 150
    assert (run_dir / "config.yaml").exists()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 150
    for name in ("learner/utilization", "learner/step_s_p50", "buffer/depth", "reward/mean",
                 "staleness/lag_mean", "is/ess", "learner/compiles"):
        assert name in records[-1], name
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tensorboard").iterdir())


@pytest.mark.timeout(900)
def test_train_on_a_device_mesh_learns(tmp_path):
    """The learner sharded over 8 simulated devices (data 2, fsdp 2, tensor 2) learns as before."""
    result = subprocess.run(
        [sys.executable, "-m", "headrace.cli", "train", "examples/guess_number.yaml", "--json",
         "--set", f"run.dir={tmp_path}/run", *SMALL,
         "--set", "parallel.mesh={data: 2, fsdp: 2, tensor: 2}", "--set", "model.vocab_size=40"],
        capture_output=True, text=True, timeout=880)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["steps"] == 150
    assert summary["final_success_rate"] >= LEARNED_SUCCESS_N8, summary
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["learner/compiles"] <= 8  # the shape set, not one program per step


def test_a_mesh_that_does_not_fit_the_model_is_one_clear_error(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "headrace.cli", "train", "examples/guess_number.yaml",
         "--set", f"run.dir={tmp_path}/run", "--set", "run.max_steps=1",
         "--set", "parallel.mesh={data: 1, fsdp: 1, tensor: 8}"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "replicated" in result.stderr and "parallel.max_replicated_share" in result.stderr


@pytest.mark.timeout(1000)
def test_two_learner_processes_train_checkpoint_and_resume_through_the_supervisor(tmp_path):
    """parallel.processes=2: the supervisor starts two learner processes joined by
    jax.distributed (coordinator on loopback), each a consumer of the buffer. Stopped by the
    supervisor (SIGTERM, at run.max_train_s: counted from the first trained step, so a slow
    start-up on a loaded machine does not eat the training time) they agree on the step to stop
    at and checkpoint together; `--resume` carries on from that checkpoint with both processes'
    counts."""
    from headrace.learner.checkpoint import Checkpointer

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    run_dir = tmp_path / "run"
    base = [sys.executable, "-m", "headrace.cli", "train", "--json"]

    def train(*args: str) -> dict:
        result = subprocess.run([*base, *args], capture_output=True, text=True, timeout=450,
                                env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "did not stop" not in result.stderr, result.stderr[-3000:]  # no kill needed
        return json.loads(result.stdout)

    def latest() -> dict:
        with Checkpointer(run_dir / "checkpoints") as checkpointer:
            return checkpointer.read_metadata()

    summary = train("examples/guess_number.yaml",
                    "--set", f"run.dir={run_dir}", "--set", "run.launcher=processes",
                    "--set", "parallel.processes=2", "--set", "parallel.mesh={data: -1}",
                    "--set", "run.max_wall_s=400", "--set", "run.max_train_s=15",  # 400: a safety cap
                    "--set", "run.checkpoint_every=3",
                    "--set", "run.eval_every=0", "--set", "learner.groups_per_batch=8",
                    "--set", "actor.envs_per_actor=128")
    steps = summary["steps"]
    assert summary["stopped_by"] == "max_train_s" and steps >= 1 and not summary["errors"], summary
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["learner/groups"] == steps * 8  # both processes' shares, counted once each
    metadata = latest()  # the final checkpoint, at the step both processes stopped at
    assert metadata["learner_step"] == steps and len(metadata["hosts"]) == 2
    summary = train("--resume", str(run_dir), "--set", f"run.max_steps={steps + 3}",
                    "--set", "run.max_wall_s=0", "--set", "run.max_train_s=0")
    assert summary["steps"] == steps + 3 and not summary["errors"], summary
    metadata = latest()
    assert metadata["learner_step"] == steps + 3 and len(metadata["hosts"]) == 2
    assert metadata["counters"]["learner/groups"] == (steps + 3) * 8  # restored, counted on
