"""`headrace bench audit --quick --json` measures, predicts and runs every pool; every key is there,
the pools are sized by Little's law from the measurement, each is run under the staleness limit
that admits it (and its measured lag stays within it), and the simulation predicts more
utilisation for a larger pool."""

import json
import math

import pytest

from headrace.audit.audit import admitting_limits
from tests.e2e.benchrun import run_headrace

POINT_KEYS = ("actors", "envs_per_actor", "measured_utilization", "predicted_utilization",
              "measured_lag_mean", "predicted_lag_mean")
GROUP_SIZE = 8  # the utilisation benchmark's workload
# Pools 8x apart: the larger one's predicted utilisation is higher, or equal up to this where
# the learner is saturated in both (the simulation's sampling noise there is well below it).
SATURATED_NOISE = 0.05


@pytest.mark.timeout(600)
def test_quick_bench_prints_every_key_and_sizes_pools_as_documented():
    result = run_headrace(["bench", "audit", "--quick", "--json"], timeout_s=580)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "headrace bench audit: simulating pool 1/" in result.stderr  # not minutes of silence
    data = json.loads(result.stdout)
    per_batch = data["settings"]["groups_per_batch"]
    assert [p["factor"] for p in data["points"]] == [0.25, 1.0, 2.0]
    for point in data["points"]:
        for key in POINT_KEYS:
            assert key in point, key
        envs = point["actors"] * point["envs_per_actor"]
        assert point["actors"] >= 1 and point["envs_per_actor"] >= 8
        assert 0 <= point["predicted_utilization"] <= 1
        assert 0 <= point["measured_utilization"] <= 1
        # Each pool ran under the limit that admits it, and the gate held it there.
        assert point["max_policy_lag"] == admitting_limits(envs, GROUP_SIZE, per_batch)[0]
        if point["measured_lag_mean"] is not None:
            assert 0 <= point["measured_lag_mean"] <= point["max_policy_lag"], point
    sizes = [p["actors"] * p["envs_per_actor"] for p in data["points"]]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    predicted = [p["predicted_utilization"] for p in data["points"]]
    assert predicted[-1] >= predicted[0] - SATURATED_NOISE, predicted
    # Little's law from the measurement: groups in flight = consume rate x group latency.
    law = data["recommendation"]["little"]
    assert law["consume_groups_per_s"] == data["measurement"]["rates"][
        "learner_consume_groups_per_s"]
    assert law["groups_in_flight"] == pytest.approx(
        law["consume_groups_per_s"] * law["group_latency_s"])
    assert law["envs_needed"] == math.ceil(law["groups_in_flight"] * law["headroom"]
                                           * GROUP_SIZE)
    assert data["recommendation"]["actors"] >= 1
    assert set(data["targets"]) == {"utilization_within_0.05", "lag_within_25pct",
                                    "recommended_reaches_target"}
