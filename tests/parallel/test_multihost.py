"""Two learner processes joined by jax.distributed compute the update of one process.

Each process (2 simulated CPU devices) is one consumer with half of every step's groups; the mesh
spans both processes' 4 devices (data 4). Against one process training all the groups on one
device: every step's metrics (loss parts, global grad norm, importance sums) to rtol 1e-5, and the
parameters after two AdamW updates to rtol 1e-5 / atol 1e-6 on at least 98 % of entries, all
within the step size (Adam turns rounding-level gradients into visible steps: see test_step.py).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from headrace.parallel.multihost import free_port

SCRIPT = "tests.parallel.learner_process"


def run_job(out_dir, processes: int) -> dict:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", SCRIPT, str(i), str(processes), str(port),
                               str(out_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(processes)]
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


@pytest.mark.timeout(600)
def test_two_learner_processes_compute_the_update_of_one(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = run_job(tmp_path / "one", 1)
    two = run_job(tmp_path / "two", 2)
    assert list(one["metric_names"]) == list(two["metric_names"])
    assert one["metrics"].shape[0] == 2  # two learner steps
    np.testing.assert_allclose(two["metrics"], one["metrics"], rtol=1e-5, atol=1e-7)
    params = [k for k in one if k.startswith("param/")]
    close = total = 0
    for key in params:
        a, b = one[key], two[key]
        assert a.shape == b.shape, key
        ok = np.isclose(b, a, rtol=1e-5, atol=1e-6)
        close += int(ok.sum())
        total += ok.size
        assert np.abs(b - a).max() <= 2 * 1e-3 + 1e-6, key  # lr x updates
    assert close / total >= 0.98, close / total
