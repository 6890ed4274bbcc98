"""Evaluation through the real command line: periodic evaluations land exactly on multiples of
`run.eval_every` with both launchers, and `headrace eval` scores a run folder or one of its
checkpoints (the same greedy score as the run's own final evaluation) or refuses a bad path in
one line with exit status 2."""

import json
import subprocess
import sys

import pytest

EVERY, STEPS = 4, 24
TINY = [
    "--set", "env.kwargs.n=8", "--set", "env.kwargs.max_turns=3",
    "--set", f"run.max_steps={STEPS}", "--set", "run.max_wall_s=0",
    "--set", "run.stop_at_target=false", "--set", f"run.eval_every={EVERY}",
    "--set", "learner.groups_per_batch=4", "--set", "actor.envs_per_actor=32",
    "--set", "actor.max_batch=32", "--set", "buffer.capacity=8",
]


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "headrace.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def _check_curve(summary: dict) -> None:
    curve = summary["eval_curve"]
    periodic, final = curve[:-1], curve[-1]
    assert final["step"] == STEPS and final["success_rate"] == summary["final_success_rate"]
    assert len(periodic) >= 1, curve
    steps = [p["step"] for p in periodic]
    assert all(step % EVERY == 0 and 0 < step < STEPS for step in steps), steps
    assert steps == sorted(set(steps)), steps


@pytest.fixture(scope="module")
def processes_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    result = _cli("train", "examples/guess_number.yaml", "--json", "--set", f"run.dir={run_dir}",
                  "--set", "run.launcher=processes", "--set", "buffer.backend=redis",
                  "--set", "weights.backend=dir", "--set", "run.checkpoint_every=8", *TINY,
                  timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, json.loads(result.stdout)


@pytest.mark.timeout(600)
def test_processes_launcher_evaluates_exactly_at_the_multiples(processes_run):
    run_dir, _ = processes_run
    _check_curve(json.loads((run_dir / "summary.json").read_text()))
    assert (run_dir / "eval_weights" / "LATEST").is_file()  # the learner's pins


@pytest.mark.timeout(600)
def test_eval_of_the_run_folder_and_of_a_checkpoint(processes_run):
    run_dir, summary = processes_run
    result = _cli("eval", str(run_dir), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    scores = json.loads(result.stdout)  # stdout is exactly one JSON object
    assert "greedy episodes" in result.stderr and "sampled episodes" in result.stderr
    assert scores["tasks"] == 8 and scores["weights_version"] is not None
    # The newest published weights are the ones the run's final evaluation played, greedily,
    # on the same tasks of a deterministic environment: the same score, exactly.
    assert scores["greedy_success_rate"] == summary["final_success_rate"]
    assert 0.0 <= scores["sampled_success_rate"] <= 1.0
    # The last checkpoint holds the same policy, restored through Orbax.
    result = _cli("eval", str(run_dir / "checkpoints" / str(STEPS)), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    restored = json.loads(result.stdout)
    assert restored["checkpoint_step"] == STEPS and restored["learner_step"] == STEPS
    assert restored["greedy_success_rate"] == summary["final_success_rate"]
    result = _cli("eval", str(run_dir / "checkpoints" / "8"), "--episodes", "3", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["tasks"] == 3


@pytest.mark.timeout(300)
def test_bad_paths_get_one_line_and_exit_status_2(processes_run, tmp_path):
    run_dir, _ = processes_run
    (tmp_path / "checkpoints" / "5").mkdir(parents=True)
    for path, words in ((tmp_path / "missing", "no such file"),
                        (run_dir / "weights", "neither a run folder"),
                        (run_dir / "checkpoints" / "7", "no such file"),
                        (tmp_path / "checkpoints" / "5", "outside a run folder"),
                        (run_dir / "config.yaml", "not a folder")):
        result = _cli("eval", str(path))
        assert result.returncode == 2, (path, result.stderr[-2000:])
        assert "Traceback" not in result.stderr
        assert words in result.stderr and "RUN_DIR" in result.stderr, result.stderr


@pytest.mark.timeout(600)
def test_threads_launcher_evaluates_exactly_at_the_multiples(tmp_path):
    run_dir = tmp_path / "run"
    result = _cli("train", "examples/guess_number.yaml", "--json", "--set", f"run.dir={run_dir}",
                  "--set", "run.launcher=threads", "--set", "buffer.backend=memory",
                  "--set", "weights.backend=memory", *TINY, timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    _check_curve(json.loads((run_dir / "summary.json").read_text()))
    # Weights in memory are gone with the run: evaluation says so and how to keep them.
    result = _cli("eval", str(run_dir))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "weights.backend dir" in result.stderr, result.stderr
