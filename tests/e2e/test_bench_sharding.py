"""`headrace bench sharding --quick --json` reports every promised key for the four meshes, and
the parameter + optimizer bytes per device meet the target."""

import json
import subprocess
import sys

import pytest

KEYS = ("data", "fsdp", "tensor", "param_bytes_per_device", "opt_bytes_per_device", "bytes_total",
        "max_abs_diff_vs_single", "step_s")


@pytest.mark.timeout(300)
def test_quick_bench_prints_every_key():
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "sharding",
                             "--quick", "--json"], capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    meshes = json.loads(result.stdout)["meshes"]
    assert [(m["data"], m["fsdp"], m["tensor"]) for m in meshes] == [
        (8, 1, 1), (1, 8, 1), (1, 4, 2), (2, 2, 2)]
    for mesh in meshes:
        for key in KEYS:
            assert key in mesh, key
        ideal = mesh["bytes_total"] / (mesh["fsdp"] * mesh["tensor"])
        assert mesh["param_bytes_per_device"] + mesh["opt_bytes_per_device"] <= 1.1 * ideal
        assert 0 <= mesh["max_abs_diff_vs_single"] < 1e-3  # Adam's step is lr = 1e-3
        assert mesh["step_s"] > 0
