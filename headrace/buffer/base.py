"""The buffer contract (DESIGN.md, "Buffer contract") shared by every backend.

Delivery is at least once: an entry handed out by `get` and not acknowledged is handed out again,
to a restarted learner or to another consumer after `claim_idle_s`. `put` applies backpressure:
it blocks while `depth() >= capacity` and raises `BufferFull` when its timeout passes. A malformed
entry is quarantined (moved aside, counted in `buffer/quarantined`), never handed to the learner.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from headrace.types import Entry, EntryId, Group


class BufferError(RuntimeError):
    """The buffer cannot serve a request (connection lost for good, closed)."""


class BufferFull(BufferError):
    """`put` waited `timeout_s` and the buffer stayed at capacity."""


class Buffer(abc.ABC):
    """Durable store of groups between actors and learners."""

    @abc.abstractmethod
    def put(self, groups: Sequence[Group], timeout_s: float) -> list[EntryId]:
        """Appends groups in order; blocks while depth >= capacity.

        Raises:
          BufferFull: still at capacity after `timeout_s`; nothing of this call was written.
        """

    @abc.abstractmethod
    def get(self, max_groups: int, timeout_s: float) -> list[Entry]:
        """Hands out up to `max_groups` entries (fewer, possibly none, after `timeout_s`).

        Entries come in arrival order; redelivered ones carry `delivery_count > 1`. Malformed
        entries are quarantined and skipped.
        """

    @abc.abstractmethod
    def ack(self, ids: Sequence[EntryId]) -> None:
        """Confirms entries are done with (trained and checkpointed, or dropped and counted)."""

    @abc.abstractmethod
    def depth(self) -> int:
        """Undelivered entries (what `capacity` bounds)."""

    @abc.abstractmethod
    def pending(self) -> int:
        """Delivered, not yet acknowledged entries."""

    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """The `buffer/*` metrics (DESIGN.md)."""

    def close(self) -> None:
        """Releases connections; the stored entries stay (durable backends)."""
