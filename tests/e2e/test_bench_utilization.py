"""`headrace bench utilization --quick --json` runs all three ways and prints every promised key."""

import json
import subprocess
import sys

import pytest

WAY_KEYS = ("learner_utilization", "steps_per_s", "trajectories_per_s", "updates_per_trajectory",
            "lag_mean", "in_flight_mean", "dropped_lag", "warmup_s", "steal_s")


@pytest.mark.timeout(600)
def test_quick_bench_prints_every_key():
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "utilization",
                             "--quick", "--json"], capture_output=True, text=True, timeout=580)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    for way in ("learner_alone", "sync", "async"):
        for key in WAY_KEYS:
            assert key in data[way], (way, key)
        # rates are the steady state's (steps that compiled left out): a smoke run may have none
        assert data[way]["steps"] >= 1 and data[way]["steps_per_s"] >= 0, (way, data[way])
        assert data[way]["steal_s"] >= 0, (way, data[way])
    assert data["little"]["in_flight_groups_needed"] >= 0
    assert data["little"]["admission_window_groups"] >= data["little"]["envs_per_actor_async"] / 8
    assert data["async"]["updates_per_trajectory"] == data["sync"]["updates_per_trajectory"]
