"""The staleness gate: drops whole groups that are too old to train on, counting each drop.

Lag is measured against the version the batch will be trained at (the caller passes it), not the
version when the group was read: a group that waited in the learner's queue ages there too.
"""

from __future__ import annotations

import time

from headrace.config import StalenessConfig
from headrace.metrics.core import MAX, Metrics, declare
from headrace.types import Group

DROP_LAG = "lag"
DROP_AGE = "age"
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
            self.metrics.count("staleness/dropped_lag")
            return DROP_LAG
        now = time.time() if now is None else now
        if self.config.max_age_s and now - group.started > self.config.max_age_s:
            self.metrics.count("staleness/dropped_age")
            return DROP_AGE
        return None
