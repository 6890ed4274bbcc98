"""The staleness gate drops whole groups over the lag or age limit and counts each drop."""

import time

import numpy as np

from headrace.config import StalenessConfig
from headrace.learner.gate import DROP_AGE, DROP_LAG, StalenessGate
from headrace.metrics.core import Metrics
from headrace.types import Group, Trajectory


def group(versions, started):
    trajectories = []
    for i, v in enumerate(versions):
        trajectories.append(Trajectory(
            trajectory_id=f"t{i}", group_id="g", task_id="task", env="e", actor_id="a",
            tokens=np.array([1, 5, 6], np.int32), loss_mask=np.array([False, True, True]),
            behaviour_logprobs=np.zeros(3, np.float32),
            policy_version=np.array([-1, v, v + 1], np.int32), turns=[], reward=0.0,
            timings={"started": started}))
    return Group("g", "task", trajectories)


def test_lag_is_measured_from_the_oldest_token_against_the_train_version():
    metrics = Metrics()
    gate = StalenessGate(StalenessConfig(max_policy_lag=2), metrics)
    now = time.time()
    assert gate.check(group([5, 7], now), train_version=7, now=now) is None  # lag 2
    assert gate.check(group([4, 7], now), train_version=7, now=now) == DROP_LAG  # lag 3
    assert metrics.snapshot()["staleness/dropped_lag"] == 1


def test_age_limit():
    metrics = Metrics()
    gate = StalenessGate(StalenessConfig(max_policy_lag=10, max_age_s=5.0), metrics)
    now = time.time()
    assert gate.check(group([1], now - 4.0), 1, now) is None
    assert gate.check(group([1], now - 6.0), 1, now) == DROP_AGE
    snapshot = metrics.snapshot()
    assert snapshot["staleness/dropped_age"] == 1
    assert "staleness/dropped_lag" not in snapshot
