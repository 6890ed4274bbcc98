"""Failures are reported, never read as success: a dead reader, batch building or weights
publisher ends the run with stopped_by "error", the reason in summary.json's `errors` and a
non-zero exit, under both launchers; an actor that keeps failing at start-up ends a processes run
with its error after `actor.max_restarts` restarts instead of being restarted forever.

The threads launcher runs in this process, so the fault is a monkeypatch. The processes launcher
spawns its children, so the fault travels as HEADRACE_TEST_FAULT, applied in every process of the
run by tests/runtime/faults/sitecustomize.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.runtime.faults.sitecustomize import failing

FAULTS = pathlib.Path(__file__).resolve().parent / "faults"
ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = [
    "--set", "run.max_steps=100000",
    "--set", "run.stop_at_target=false", "--set", "run.eval_every=0",
    "--set", "env.kwargs.n=8", "--set", "env.kwargs.max_turns=3",
    "--set", "learner.groups_per_batch=4", "--set", "learner.minibatches=1",
    "--set", "actor.group_size=4", "--set", "actor.envs_per_actor=32",
    "--set", "actor.max_batch=32", "--set", "buffer.capacity=8",
]
# (thread kind, the method that fails in each backend, calls before it fails, the reason's words)
KINDS = {
    "reader": ("headrace.buffer.memory:MemoryBuffer.get", "headrace.buffer.redis_stream:"
               "RedisBuffer.get", 5, "the reader thread failed"),
    "batcher": ("headrace.learner.batching:Batcher.build", "headrace.learner.batching:"
                "Batcher.build", 2, "building a batch failed"),
    "publisher": ("headrace.weights.memory:MemoryWeightStore.publish", "headrace.weights."
                  "directory:DirWeightStore.publish", 3, "the weights publisher failed"),
}


def _patch(monkeypatch, spec: str, after: int) -> None:
    import importlib

    module, attribute = spec.split(":")
    owner_name, method = attribute.split(".")
    owner = getattr(importlib.import_module(module), owner_name)
    monkeypatch.setattr(owner, method, failing(getattr(owner, method), attribute, after))


def _check(summary: dict, run_dir: pathlib.Path, words: str) -> None:
    assert summary["stopped_by"] == "error", summary
    assert len(summary["errors"]) == 1 and words in summary["errors"][0], summary["errors"]
    assert "injected fault" in summary["errors"][0]
    written = json.loads((run_dir / "summary.json").read_text())
    assert written["stopped_by"] == "error" and written["errors"] == summary["errors"]
    # a failed run is reported at once: no final evaluation (eval_every=0: no periodic one)
    assert summary["final_success_rate"] is None and written["eval_curve"] == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_dead_thread_fails_a_threads_run(kind, tmp_path, monkeypatch, capsys):
    from headrace.cli import main

    threads_target, _, after, words = KINDS[kind]
    _patch(monkeypatch, threads_target, after)
    run_dir = tmp_path / "run"
    code = main(["train", "examples/guess_number.yaml", "--json", "--no-live",
                 "--set", "run.launcher=threads", "--set", f"run.dir={run_dir}", *SMALL,
                 "--set", "run.max_wall_s=0"])  # off: the test's
    # timeout is the guard against a run the fault does not end
    out = capsys.readouterr().out
    assert code == 1
    _check(json.loads(out), run_dir, words)


# run.max_wall_s of a processes run: it counts from the CLI's start (processes, imports, compiles:
# minutes on a loaded machine) and the fault, a few steps in, must come before it
WALL_S = 400


def _train_processes(tmp_path: pathlib.Path, fault: str, *extra: str):
    run_dir = tmp_path / "run"
    env = {**os.environ, "HEADRACE_TEST_FAULT": fault,
           "PYTHONPATH": os.pathsep.join([str(FAULTS), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "headrace.cli", "train", "examples/guess_number.yaml", "--json",
         "--no-live", "--set", "run.launcher=processes", "--set", f"run.dir={run_dir}", *SMALL,
         "--set", f"run.max_wall_s={WALL_S}", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=WALL_S + 50)
    return result, run_dir


@pytest.mark.timeout(500)
@pytest.mark.parametrize("kind", ["publisher", "reader"])  # the batcher's Batcher.build is the
# same code in both backends: the threads run covers it
def test_a_dead_thread_fails_a_processes_run(kind, tmp_path):
    _, target, after, words = KINDS[kind]
    result, run_dir = _train_processes(tmp_path, f"{target}:{after}")
    assert result.returncode == 1, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    _check(summary, run_dir, words)
    assert summary["errors"][0].startswith("learner exited with code 1: LearnerError: ")
    assert summary["wall_s"] < WALL_S  # ended by the failure, not by the wall-clock limit


@pytest.mark.timeout(500)
def test_an_actor_failing_at_start_up_ends_the_run_after_its_restarts(tmp_path):
    result, run_dir = _train_processes(tmp_path, "headrace.actor.actor:Actor.run:0",
                                       "--set", "actor.max_restarts=2")
    assert result.returncode == 1, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["stopped_by"] == "error" and summary["wall_s"] < WALL_S, summary
    (error,) = summary["errors"]
    assert error.startswith("actor-0 exited with code 1: RuntimeError: injected fault in "
                            "Actor.run"), error
    assert "crashed 3 times in a row; actor.max_restarts=2" in error
    assert result.stderr.count("restarting in") == 2  # backoff 1 s, then 2 s
    assert summary["steps"] == 0 and summary["episodes"] == 0


@pytest.mark.timeout(500)
def test_a_learner_failing_before_version_0_is_one_clear_line(tmp_path):
    result, _ = _train_processes(tmp_path, "headrace.learner.loop:Learner.publish_start:0")
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stdout == ""
    line = ("headrace: the learner exited before publishing version 0: learner exited with code "
            "1: RuntimeError: injected fault in Learner.publish_start (call 1)")
    assert any(text.startswith(line) for text in result.stderr.splitlines()), \
        result.stderr[-3000:]
