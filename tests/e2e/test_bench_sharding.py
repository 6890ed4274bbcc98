"""`headrace bench sharding --quick --json` reports every promised key for the four meshes; the
parameter + optimizer bytes per device meet the target, and show the sharding really happened:
data parallelism keeps a whole copy per device, fsdp x tensor splits it, and the optimizer state
is split like the parameters."""

import json
import subprocess
import sys

import pytest

KEYS = ("data", "fsdp", "tensor", "param_bytes_per_device", "opt_bytes_per_device", "bytes_total",
        "max_abs_diff_vs_single", "step_s")
# Adam keeps two moments shaped like the parameters, plus step counters (a few scalars, on every
# device): the optimizer's bytes per device are twice the parameters' plus at most this.
COUNTER_BYTES = 64


@pytest.mark.timeout(300)
def test_quick_bench_prints_every_key_and_the_state_is_sharded():
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "sharding",
                             "--quick", "--json"], capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    meshes = json.loads(result.stdout)["meshes"]
    assert [(m["data"], m["fsdp"], m["tensor"]) for m in meshes] == [
        (8, 1, 1), (1, 8, 1), (1, 4, 2), (2, 2, 2)]
    total = meshes[0]["bytes_total"]
    for mesh in meshes:
        for key in KEYS:
            assert key in mesh, key
        assert mesh["bytes_total"] == total  # one model
        split = mesh["fsdp"] * mesh["tensor"]
        per_device = mesh["param_bytes_per_device"] + mesh["opt_bytes_per_device"]
        # Measured from the live arrays' shards: no device holds less than an even split of
        # the model (nothing is lost or under-counted), none more than 10 % over it.
        assert total / split <= per_device <= 1.1 * total / split, mesh
        assert 0 <= mesh["opt_bytes_per_device"] - 2 * mesh["param_bytes_per_device"] \
            <= COUNTER_BYTES, mesh
        assert 0 <= mesh["max_abs_diff_vs_single"] < 1e-3  # Adam's step is lr = 1e-3
        assert mesh["step_s"] > 0
    data_parallel = meshes[0]
    assert data_parallel["param_bytes_per_device"] + data_parallel["opt_bytes_per_device"] \
        == total  # replicated: a whole copy on every device
    for mesh in meshes[1:]:  # sharded 4 or 8 ways: well under half the unsharded bytes
        assert mesh["param_bytes_per_device"] + mesh["opt_bytes_per_device"] < total / 2, mesh
