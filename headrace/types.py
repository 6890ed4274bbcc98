"""The records every component shares: trajectories, groups and buffer entries.

A `Trajectory` is one recorded episode exactly as the policy saw it (docs/design.md, "Trajectory and
group"); a `Group` is the G trajectories an actor produced for one task, the unit the buffer stores.
Arrays are NumPy (never JAX): these records cross process boundaries and are serialized by
`headrace.buffer.serialize`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

SCHEMA_VERSION = 1

STATUS_OK = "ok"
STATUS_TRUNCATED = "truncated"
STATUS_ERROR = "error"
STATUSES = (STATUS_OK, STATUS_TRUNCATED, STATUS_ERROR)

ROLES = ("system", "user", "assistant", "tool")

EntryId = str


def as_ints(values: Sequence[int]) -> list[int]:
    """Token ids as a list of Python ints: an integer array's in one C call (`tolist`; per-element
    conversion of a short array costs more than the rest of a turn's bookkeeping), a list as it is
    (the context lists passed around are built of ints already: converting them again would be a
    Python loop per token; the list is returned, not copied), anything else one by one."""
    if isinstance(values, list):
        return values
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        return values.tolist()
    return [int(v) for v in values]


@dataclasses.dataclass
class Turn:
    """One turn of an episode: tokens [start, end) of the trajectory, who produced them, its reward."""

    start: int
    end: int
    role: str
    reward: float = 0.0


@dataclasses.dataclass
class Trajectory:
    """One episode from `reset` to done, as token ids plus the metadata off-policy learning needs.

    Per-token arrays all have length T = len(tokens). `behaviour_logprobs` is the log-probability of
    each generated token under the temperature-scaled, untruncated sampling distribution (0 elsewhere);
    `policy_version` is the weights version that generated each token (-1 on non-generated tokens).
    """

    trajectory_id: str
    group_id: str
    task_id: str
    env: str
    actor_id: str
    tokens: np.ndarray  # int32[T]
    loss_mask: np.ndarray  # bool[T]
    behaviour_logprobs: np.ndarray  # float32[T]
    policy_version: np.ndarray  # int32[T]
    turns: list[Turn]
    reward: float
    status: str = STATUS_OK
    error: str | None = None
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @functools.cached_property
    def oldest_version(self) -> int:
        """Oldest weights version that generated any token; -1 when no token was generated."""
        generated = self.policy_version[self.loss_mask]
        return int(generated.min()) if generated.size else -1

    def validate(self) -> None:
        """Raises ValueError naming the first field that breaks the schema."""
        n = len(self)
        if self.tokens.ndim != 1 or self.tokens.dtype != np.int32:
            raise ValueError(f"tokens must be int32[T], got {self.tokens.dtype}{list(self.tokens.shape)}")
        for name, dtype in (("loss_mask", np.bool_), ("behaviour_logprobs", np.float32),
                            ("policy_version", np.int32)):
            array = getattr(self, name)
            if array.shape != (n,) or array.dtype != dtype:
                raise ValueError(f"{name} must be {np.dtype(dtype).name}[{n}], "
                                 f"got {array.dtype}{list(array.shape)}")
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        for turn in self.turns:
            if not (isinstance(turn.start, int) and isinstance(turn.end, int)
                    and isinstance(turn.reward, (int, float)) and 0 <= turn.start <= turn.end <= n
                    and turn.role in ROLES):
                raise ValueError(f"turn {turn} does not fit a trajectory of {n} tokens")


@dataclasses.dataclass
class Group:
    """The G trajectories of one task (all share `group_id` and `task_id`)."""

    group_id: str
    task_id: str
    trajectories: list[Trajectory]
    # Learner version when the actor put the group (for the lag split: generation vs queue).
    put_version: int = -1

    @property
    def oldest_version(self) -> int:
        versions = [t.oldest_version for t in self.trajectories if t.oldest_version >= 0]
        return min(versions) if versions else -1

    @property
    def started(self) -> float:
        """Unix time the earliest episode of the group started (for its age)."""
        return min((t.timings.get("started", np.inf) for t in self.trajectories), default=np.inf)

    def validate(self) -> None:
        if not self.trajectories:
            raise ValueError(f"group {self.group_id} has no trajectories")
        for trajectory in self.trajectories:
            trajectory.validate()
            if trajectory.group_id != self.group_id:
                raise ValueError(f"trajectory {trajectory.trajectory_id} names group "
                                 f"{trajectory.group_id}, not {self.group_id}")


@dataclasses.dataclass(frozen=True)
class Entry:
    """What a buffer hands a learner: the entry id, the group, and how often it was delivered."""

    id: EntryId
    group: Group
    delivery_count: int = 1
