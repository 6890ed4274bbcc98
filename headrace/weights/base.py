"""The weight store contract: versioned policy parameters from the learner to the actors.

Parameters travel as a flat mapping from a dotted parameter path (e.g. `layers.0.attn.q.kernel`) to
a NumPy array. Version 0 is published before any actor acts; the store keeps the last `keep`
versions and `load` of a pruned version raises `VersionGone`.

Pickups close the loop for tracing: an actor that starts sampling with a version notes it
(`note_pickup`), and the learner asks when a version was first picked up (`pickup_time`). The
default keeps the times in this object (enough when actors and learner share a process); stores
reached from several processes override both.
"""

from __future__ import annotations

import abc

import numpy as np

Params = dict[str, np.ndarray]


class VersionGone(KeyError):
    """The requested version was pruned (or never published)."""


class WeightStore(abc.ABC):
    @abc.abstractmethod
    def publish(self, params: Params, version: int) -> None:
        """Stores `params` as `version` (greater than every earlier one) and prunes old versions."""

    @abc.abstractmethod
    def latest_version(self) -> int:
        """The newest complete version, or -1 before the first publish. Cheap; safe to poll."""

    @abc.abstractmethod
    def load(self, version: int) -> Params:
        """The parameters of `version`.

        Raises:
          VersionGone: the version was pruned or never published.
        """

    def note_pickup(self, version: int, at: float) -> None:
        """Records that an actor began sampling with `version` at unix time `at` (first one wins)."""
        pickups = self.__dict__.setdefault("_pickups", {})
        pickups.setdefault(version, at)

    def pickup_time(self, version: int) -> float | None:
        """Unix time `version` was first picked up by any actor, or None if not (yet)."""
        return self.__dict__.get("_pickups", {}).get(version)

    def close(self) -> None:
        """Releases resources; published versions stay (durable backends)."""
