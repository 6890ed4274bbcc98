"""The learner's gates: drop whole groups too old to train on (the staleness gate) or, with
`learner.drop_uniform_groups`, with nothing to teach; each drop counted by reason.

Lag is measured against the version the batch will be trained at (the caller passes it), not the
version when the group was read: a group that waited in the learner's queue ages there too.
"""

from __future__ import annotations

import time

from headrace.config import StalenessConfig
from headrace.learner.advantages import uniform
from headrace.metrics.core import MAX, Metrics, declare
from headrace.types import STATUS_ERROR, Group

DROP_LAG = "lag"
DROP_AGE = "age"
DROP_UNIFORM = "uniform"
# Each drop reason's counter (the ledger's reasons; `headrace.runtime.accounting` checks them).
DROP_COUNTERS = {DROP_LAG: "staleness/dropped_lag", DROP_AGE: "staleness/dropped_age",
                 DROP_UNIFORM: "learner/dropped_uniform"}
# The learner's staleness gauges: the largest lag of a trained batch is the worst process's.
LAG_MAX = declare("staleness/lag_max", MAX)


class StalenessGate:
    def __init__(self, config: StalenessConfig, metrics: Metrics):
        self.config = config
        self.metrics = metrics

    def check(self, group: Group, train_version: int, now: float | None = None) -> str | None:
        """None if the group may be trained at `train_version`, else the drop reason (counted)."""
        lag = train_version - group.oldest_version
        if group.oldest_version >= 0 and lag > self.config.max_policy_lag:
            self.metrics.count(DROP_COUNTERS[DROP_LAG])
            return DROP_LAG
        now = time.time() if now is None else now
        if self.config.max_age_s and now - group.started > self.config.max_age_s:
            self.metrics.count(DROP_COUNTERS[DROP_AGE])
            return DROP_AGE
        return None


def uninformative(group: Group, metrics: Metrics) -> str | None:
    """DROP_UNIFORM (counted) if the group's rewards teach nothing (`advantages.uniform`: its
    valid members, those not ended by an error, all got the same reward), else None."""
    trajectories = group.trajectories
    if not uniform([t.reward for t in trajectories],
                   [t.status != STATUS_ERROR for t in trajectories]):
        return None
    metrics.count(DROP_COUNTERS[DROP_UNIFORM])
    return DROP_UNIFORM
