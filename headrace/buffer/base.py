"""The buffer contract (docs/design.md, "Buffer contract") shared by every backend.

Delivery is at least once: an entry handed out by `get` and not acknowledged is handed out again,
to a restarted learner or to another consumer after `claim_idle_s`. `put` applies backpressure:
it blocks while `depth() >= capacity` and raises `BufferFull` when its timeout passes.

Quarantine: an entry that does not decode to a valid group (`serialize.decode`: structure and
values) is moved aside with its bytes and reason, acknowledged off the stream, counted in
`buffer/quarantined` and `buffer/quarantined_<reason>` (`serialize.QUARANTINE_REASONS`), logged,
and never handed out or redelivered. A consumer that finds a defect only it can see (a token id
past its model's vocabulary) quarantines a delivered entry the same way (`quarantine`).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence

from headrace.buffer.serialize import QUARANTINE_REASONS
from headrace.metrics.core import MAX, SUM, Distribution, declare
from headrace.types import Entry, EntryId, Group

# `stats()` latencies: a sharded buffer reports its slowest shard's (its counts and rates add up
# over shards); across processes a tail latency is the slowest process's, a median the mean.
LATENCIES = ("buffer/put_ms_p50", declare("buffer/put_ms_p99", MAX),
             declare("buffer/get_ms_p99", MAX))
# What each process's client measures of its own calls adds up over processes (the learner's
# consumption, every actor's blocked puts); depth, pending, quarantined and `ingest_per_s` are
# the server's, the same in every process's `stats`, so their mean is the value.
PER_CLIENT = tuple(declare(name, SUM) for name in (
    "buffer/consume_per_s", "buffer/put_blocked_s", "buffer/redelivered", "buffer/reconnects"))


def stats_record(*, depth: int, pending: int, ingest_per_s: float, consume_per_s: float,
                 put_ms: Distribution, get_ms: Distribution, put_blocked_s: float,
                 redelivered: int, quarantined: int, reasons: Mapping[str, int]
                 ) -> dict[str, float]:
    """The `buffer/*` metrics every backend's `stats` reports (docs/metrics.md), from its counts."""
    put_p50, put_p99 = put_ms.quantiles((0.5, 0.99))
    (get_p99,) = get_ms.quantiles((0.99,))
    return {
        "buffer/depth": depth, "buffer/pending": pending,
        "buffer/ingest_per_s": ingest_per_s, "buffer/consume_per_s": consume_per_s,
        "buffer/put_ms_p50": put_p50, "buffer/put_ms_p99": put_p99, "buffer/get_ms_p99": get_p99,
        "buffer/put_blocked_s": put_blocked_s, "buffer/redelivered": redelivered,
        "buffer/quarantined": quarantined,
        **{f"buffer/quarantined_{r}": reasons.get(r, 0) for r in QUARANTINE_REASONS},
    }


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
    def quarantine(self, entry_id: EntryId, reason: str, message: str) -> None:
        """Moves a delivered, unacknowledged entry aside as malformed (kept with its bytes,
        `reason` and `message`; counted; never delivered again). An id that is not pending is
        left alone (idempotent)."""

    @abc.abstractmethod
    def depth(self) -> int:
        """Undelivered entries (what `capacity` bounds)."""

    @abc.abstractmethod
    def pending(self) -> int:
        """Delivered, not yet acknowledged entries."""

    def counts(self) -> tuple[int, int]:
        """(undelivered, pending), what in-process admission control reads; a backend that can
        read both at once overrides this."""
        return self.depth(), self.pending()

    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """The `buffer/*` metrics (docs/metrics.md)."""

    def share_with(self, consumers: Sequence[str]) -> None:
        """Names the consumers that live and die with this one (the other processes of one
        learner): entries they hold are never claimed after `claim_idle_s` (they are held, not
        abandoned; a restart of the whole learner re-reads its own). A single-process backend
        has no other consumer: nothing to do."""

    def close(self) -> None:
        """Releases connections; the stored entries stay (durable backends)."""
