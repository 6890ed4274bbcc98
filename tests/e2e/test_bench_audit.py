"""`headrace bench audit --quick --json` measures, predicts and runs every pool; every key is there."""

import json
import subprocess
import sys

import pytest

POINT_KEYS = ("actors", "envs_per_actor", "measured_utilization", "predicted_utilization",
              "measured_lag_mean", "predicted_lag_mean")


@pytest.mark.timeout(600)
def test_quick_bench_prints_every_key():
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "audit", "--quick",
                             "--json"], capture_output=True, text=True, timeout=580)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    assert [p["factor"] for p in data["points"]] == [0.25, 1.0, 2.0]
    for point in data["points"]:
        for key in POINT_KEYS:
            assert key in point, key
        assert point["actors"] >= 1 and point["envs_per_actor"] >= 8
        assert 0 <= point["predicted_utilization"] <= 1
    sizes = [p["actors"] * p["envs_per_actor"] for p in data["points"]]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    assert data["recommendation"]["actors"] >= 1
    assert set(data["targets"]) == {"utilization_within_0.05", "lag_within_25pct",
                                    "recommended_reaches_target"}
