"""Two learner processes joined by jax.distributed compute the update of one process.

Each process (2 simulated CPU devices) is one consumer with half of every step's groups; the mesh
spans both processes' 4 devices (data 4). Against one process training all the groups on one
device: every step's metrics (loss parts, global grad norm, importance sums) to rtol 1e-5, and the
parameters after two AdamW updates to rtol 1e-5 / atol 1e-6 on at least 98 % of entries, all
within the step size (Adam turns rounding-level gradients into visible steps: see test_step.py).

Checkpoints: a two-process job that checkpoints, stops, and is resumed by a second two-process job
trains the same four steps as one process does without stopping; process 0 alone wrote the
metadata, which holds both processes' bookkeeping; and the checkpoint restores in one process onto
one device (another mesh shape).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from headrace.parallel.multihost import free_port

SCRIPT = "tests.parallel.learner_process"


def run_job(out_dir, processes: int, *extra) -> dict:
    out_dir.mkdir(exist_ok=True)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", SCRIPT, str(i), str(processes), str(port),
                               str(out_dir), *map(str, extra)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(processes)]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output[-3000:]
    data = np.load(out_dir / "result.npz")
    return {k: data[k] for k in data.files}


def assert_same_update(one: dict, two: dict) -> None:
    assert list(one["metric_names"]) == list(two["metric_names"])
    np.testing.assert_allclose(two["metrics"], one["metrics"], rtol=1e-5, atol=1e-7)
    params = [k for k in one if k.startswith("param/")]
    close = total = 0
    for key in params:
        a, b = one[key], two[key]
        assert a.shape == b.shape, key
        ok = np.isclose(b, a, rtol=1e-5, atol=1e-6)
        close += int(ok.sum())
        total += ok.size
        assert np.abs(b - a).max() <= len(one["metrics"]) * 1e-3 + 1e-6, key  # lr x updates
    assert close / total >= 0.98, close / total


@pytest.mark.timeout(600)
def test_two_learner_processes_compute_the_update_of_one(tmp_path):
    one = run_job(tmp_path / "one", 1)
    two = run_job(tmp_path / "two", 2)
    assert one["metrics"].shape[0] == 2  # two learner steps
    assert_same_update(one, two)


@pytest.mark.timeout(600)
def test_a_process_far_behind_on_its_first_program_is_waited_for(tmp_path, monkeypatch):
    # Process 1 reaches the step's program 40 s after process 0 (as when it compiles a program
    # process 0 loads from the persistent cache, on a loaded machine): past Gloo's fixed 30 s for
    # a collective, so process 0 must wait before it runs the program, not inside it.
    monkeypatch.setenv("SLOW_FIRST_PROGRAM_S", "40")
    two = run_job(tmp_path / "two", 2)
    assert two["metrics"].shape[0] == 2  # both learner steps


@pytest.mark.timeout(600)
def test_two_precompiling_processes_compute_the_update_of_one(tmp_path, monkeypatch):
    # learner.precompile: each process compiles its (sharded) programs before the first batch
    # and meets the other at a barrier; the steps run on those programs and compute what one
    # process computes.
    monkeypatch.setenv("PRECOMPILE", "1")
    one = run_job(tmp_path / "one", 1)
    two = run_job(tmp_path / "two", 2)
    assert one["metrics"].shape[0] == 2
    assert_same_update(one, two)
    for job in (one, two):  # compiled before the first step; no step compiled
        assert job["precompile_s"] > 0 and job["compile_s"] == 0


def restore_on_one_device(ckpt, step: int) -> dict:
    """The parameters of checkpoint `step`, restored here onto the default device."""
    import jax

    from headrace.config import load
    from headrace.learner.checkpoint import Checkpointer
    from headrace.learner.train_step import init_state, make_optimizer
    from headrace.model import params as params_lib
    from headrace.runtime import build

    config = load("examples/guess_number.yaml", ["learner.entropy_coef=0.01"])
    _, params = build.init_params(config, build.build_task(config))
    abstract = jax.eval_shape(lambda p: init_state(p, make_optimizer(config.learner.optimizer),
                                                   config.learner.kl_coef), params)
    with Checkpointer(ckpt) as checkpointer:
        state, _ = checkpointer.restore(abstract, step)
    return params_lib.to_host(state.params)


@pytest.mark.timeout(900)
def test_two_learner_processes_checkpoint_and_resume(tmp_path):
    from headrace.learner.checkpoint import Checkpointer

    ckpt = tmp_path / "ckpt"
    one = run_job(tmp_path / "one", 1, 4)  # four steps, no stop
    first = run_job(tmp_path / "first", 2, 2, ckpt)  # steps 1-2, checkpointed
    np.testing.assert_allclose(first["metrics"], one["metrics"][:2], rtol=1e-5, atol=1e-7)
    with Checkpointer(ckpt) as checkpointer:
        metadata = checkpointer.read_metadata(2)
    assert metadata["learner_step"] == 2 and len(metadata["hosts"]) == 2
    assert metadata["counters"]["learner/groups"] == 2 * 4  # both processes' counts, summed
    assert [h["counters"]["learner/groups"] for h in metadata["hosts"]] == [4, 4]
    assert sorted(metadata["unacked"]) == sorted(i for h in metadata["hosts"]
                                                 for i in h["unacked"])
    # Written on a mesh over two processes' devices, read in one process onto one device.
    restored = restore_on_one_device(ckpt, 2)
    for key, value in first.items():
        if key.startswith("param/"):
            np.testing.assert_array_equal(restored[key[len("param/"):]], value)
    resumed = run_job(tmp_path / "resumed", 2, 4, ckpt)  # restores step 2, trains 3-4
    assert resumed["metrics"].shape[0] == 2
    assert_same_update({**one, "metrics": one["metrics"][2:]}, resumed)
