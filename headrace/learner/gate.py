"""The learner's gates: drop whole groups too old to train on (the staleness gate) or, with
`learner.drop_uniform_groups`, with nothing to teach; each drop counted by reason.

Lag is measured against the version the batch will be trained at (the caller passes it), not the
version when the group was read: a group that waited in the learner's queue ages there too.
"""

from __future__ import annotations

import math
import time

from headrace.config import LearnerConfig, StalenessConfig
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


class UniformDrops:
    """`learner.drop_uniform_groups`: which groups whose rewards teach nothing a learner step
    drops (`advantages.uniform`: its valid members, those not ended by an error, all got the same
    reward). Each one, until the step has dropped `limit` (`uniform_drop_limit` batches' worth);
    past that it trains those that come, so when a settled policy makes nearly every group alike,
    a step costs the actors at most 1 + `uniform_drop_limit` batches of episodes (DAPO's cap on
    generation rounds) and the learner never waits for ever. The learner's feed and the bare
    loop (`headrace bench bare`) both decide with it."""

    def __init__(self, limit: int, metrics: Metrics | None = None):
        self.limit = limit
        self.metrics = metrics
        self.dropped = 0  # this step's

    @classmethod
    def from_config(cls, learner: LearnerConfig, need: int,
                    metrics: Metrics | None = None) -> UniformDrops | None:
        """The policy for steps of `need` groups, or None when `drop_uniform_groups` is off."""
        if not learner.drop_uniform_groups:
            return None
        return cls(math.ceil(learner.uniform_drop_limit * need), metrics)

    def drop(self, rewards, valid) -> bool:
        """Whether this step drops the group of `rewards` (`valid`: its members in the baseline);
        counted: `learner/dropped_uniform`, or `learner/uniform_kept` past the limit."""
        if not uniform(rewards, valid):
            return False
        if self.dropped < self.limit:
            self.dropped += 1
            self._count(DROP_COUNTERS[DROP_UNIFORM])
            return True
        self._count("learner/uniform_kept")
        return False

    def group(self, group: Group) -> str | None:
        """`drop` for a buffer group: DROP_UNIFORM, or None when it is trained."""
        trajectories = group.trajectories
        dropped = self.drop([t.reward for t in trajectories],
                            [t.status != STATUS_ERROR for t in trajectories])
        return DROP_UNIFORM if dropped else None

    def next_step(self) -> None:
        self.dropped = 0

    def _count(self, name: str) -> None:
        if self.metrics is not None:
            self.metrics.count(name)
