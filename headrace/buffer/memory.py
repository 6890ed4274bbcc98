"""In-memory buffer backend: the contract of `headrace.buffer.base` for single-process runs and tests.

Entries are stored serialized, exactly as the Redis backend stores them, so serialization and
quarantine are exercised the same way. Nothing survives the process: `restart_consumer()` stands in
for a restarted learner (every pending entry becomes deliverable again). Quarantined entries stay
in `quarantined` (id -> bytes, reason, message) for inspection.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence

from headrace.buffer.base import Buffer, BufferFull, stats_record
from headrace.buffer.serialize import MalformedEntry, decode, encode
from headrace.metrics.core import Distribution, RateMeter
from headrace.types import Entry, EntryId, Group

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Pending:
    data: bytes
    deliveries: int
    delivered_at: float


class MemoryBuffer(Buffer):
    def __init__(self, capacity: int = 64, max_pending: int = 1024, claim_idle_s: float = 60.0):
        self.capacity = capacity
        self.max_pending = max_pending
        self.claim_idle_s = claim_idle_s
        self._ready: collections.OrderedDict[EntryId, tuple[bytes, int]] = collections.OrderedDict()
        self._pending: collections.OrderedDict[EntryId, _Pending] = collections.OrderedDict()
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self.quarantined: dict[EntryId, tuple[bytes, str, str]] = {}  # bytes, reason, message
        self._reasons: collections.Counter[str] = collections.Counter()
        self._redelivered = 0
        self._put_blocked_s = 0.0
        self._put_ms = Distribution()
        self._get_ms = Distribution()
        self._ingest = RateMeter()
        self._consume = RateMeter()

    def put(self, groups: Sequence[Group], timeout_s: float) -> list[EntryId]:
        start = time.perf_counter()
        encoded = [encode(g) for g in groups]
        deadline = time.monotonic() + timeout_s
        with self._cond:
            blocked_from = None
            while len(self._ready) + len(encoded) > max(self.capacity, len(encoded)):
                blocked_from = blocked_from or time.perf_counter()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._put_blocked_s += time.perf_counter() - blocked_from
                    raise BufferFull(f"buffer stayed at capacity {self.capacity} for {timeout_s} s")
                self._cond.wait(remaining)
            if blocked_from is not None:
                self._put_blocked_s += time.perf_counter() - blocked_from
            ids = [f"{next(self._ids)}-0" for _ in encoded]
            for entry_id, data in zip(ids, encoded):
                self._ready[entry_id] = (data, 0)
            self._ingest.add(len(ids))
            self._put_ms.add((time.perf_counter() - start) * 1e3)
            self._cond.notify_all()
        return ids

    def put_raw(self, data: bytes) -> EntryId:
        """Appends bytes as they are (tests use it to plant malformed entries)."""
        with self._cond:
            entry_id = f"{next(self._ids)}-0"
            self._ready[entry_id] = (data, 0)
            self._cond.notify_all()
            return entry_id

    def _claim_idle(self, now: float) -> None:
        for entry_id in list(self._pending):
            item = self._pending[entry_id]
            if now - item.delivered_at < self.claim_idle_s:
                break  # pending is in delivery order
            del self._pending[entry_id]
            self._ready[entry_id] = (item.data, item.deliveries)
            self._ready.move_to_end(entry_id, last=False)

    def get(self, max_groups: int, timeout_s: float) -> list[Entry]:
        start = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        entries: list[Entry] = []
        with self._cond:
            while True:
                self._claim_idle(time.monotonic())
                room = min(max_groups, self.max_pending - len(self._pending))
                if self._ready and room > 0:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._cond.wait(min(remaining, self.claim_idle_s))
            now = time.monotonic()
            while self._ready and len(entries) < room:
                entry_id, (data, deliveries) = self._ready.popitem(last=False)
                try:
                    group = decode(data)  # raises MalformedEntry only
                except MalformedEntry as error:
                    self._set_aside(entry_id, data, error.reason, str(error))
                    continue
                deliveries += 1
                self._redelivered += deliveries > 1
                self._pending[entry_id] = _Pending(data, deliveries, now)
                entries.append(Entry(entry_id, group, deliveries))
            self._consume.add(len(entries))
            self._get_ms.add((time.perf_counter() - start) * 1e3)
            self._cond.notify_all()
        return entries

    def _set_aside(self, entry_id: EntryId, data: bytes, reason: str, message: str) -> None:
        self.quarantined[entry_id] = (data, reason, message)
        self._reasons[reason] += 1
        log.warning("quarantined malformed entry %s (%s): %s", entry_id, reason, message)

    def quarantine(self, entry_id: EntryId, reason: str, message: str) -> None:
        with self._cond:
            item = self._pending.pop(entry_id, None)
            claimed = self._ready.pop(entry_id, None)  # claimed back after claim_idle_s
            if item is not None or claimed is not None:
                data = item.data if item is not None else claimed[0]
                self._set_aside(entry_id, data, reason, message)
            self._cond.notify_all()

    def ack(self, ids: Sequence[EntryId]) -> None:
        with self._cond:
            for entry_id in ids:
                self._pending.pop(entry_id, None)
                self._ready.pop(entry_id, None)  # claimed back after claim_idle_s: done with
            self._cond.notify_all()

    def restart_consumer(self) -> None:
        """Makes every pending entry deliverable again, as a restarted learner would see them."""
        with self._cond:
            for entry_id, item in reversed(self._pending.items()):
                self._ready[entry_id] = (item.data, item.deliveries)
                self._ready.move_to_end(entry_id, last=False)
            self._pending.clear()
            self._cond.notify_all()

    def depth(self) -> int:
        with self._cond:
            return len(self._ready)

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def counts(self) -> tuple[int, int]:
        """(undelivered, pending), read together (what admission control needs)."""
        with self._cond:
            return len(self._ready), len(self._pending)

    def stats(self) -> dict[str, float]:
        with self._cond:
            return stats_record(
                depth=len(self._ready), pending=len(self._pending),
                ingest_per_s=self._ingest.rate(), consume_per_s=self._consume.rate(),
                put_ms=self._put_ms, get_ms=self._get_ms, put_blocked_s=self._put_blocked_s,
                redelivered=self._redelivered, quarantined=len(self.quarantined),
                reasons=self._reasons)
