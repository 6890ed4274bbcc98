"""An actor's buffer writes: finished groups that wait while its writes are in flight go in the
next write together.

A write stamps its groups (the newest published version, the put time), appends them to the buffer
in one `put` (all or none) and then releases their admission leases in one call (admission's
protocol: a lease is released once its group is in the buffer). At most `MAX_WRITES` writes are in
flight per actor; a group finished meanwhile waits, so as the actor's rate rises each write carries
more groups (at most `MAX_WRITE_GROUPS`, and never more than the buffer's capacity) and the store's
round trips per group fall: each write is three (a reserve and an append for the put, one for the
release), however many groups it carries.

A write refused at capacity (`BufferFull` after `PUT_SLICE_S`) puts its groups back at the front;
the next carries half as many (the most again after one succeeds: a write needs all its slots
free at once, so one that stayed large could lose every freed slot to smaller writes). A stop is
never held up for long; blocked for `buffer.put_timeout_s` in total a write is logged and counted
(`actor/put_timeouts`) and still retried: a group is never dropped.
On stop, groups not yet written are abandoned (their slots release the leases). A write that fails
otherwise (the store lost) fails every group in it: their slots raise, which fails the actor
(`Actor._act` raises the first error of a slot or of the policy).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time

from headrace.buffer.admission import Admission, Lease
from headrace.buffer.base import Buffer, BufferFull
from headrace.metrics.core import Metrics
from headrace.types import Group
from headrace.weights.base import WeightStore

log = logging.getLogger(__name__)

MAX_WRITES = 2  # buffer writes in flight per actor at most (each holds a Redis connection)
MAX_WRITE_GROUPS = 16  # groups one write carries at most
PUT_SLICE_S = 0.25  # longest a write blocks at capacity before the stop event is checked again


@dataclasses.dataclass(eq=False)
class _Unwritten:
    group: Group
    lease: Lease | None
    written: asyncio.Future  # done once in the buffer and the lease released
    taken: bool = False  # in a write now


class GroupWriter:
    """Writes one actor's groups (create it on the actor's event loop)."""

    def __init__(self, buffer: Buffer, weights: WeightStore, admission: Admission | None,
                 metrics: Metrics, stop: threading.Event, *, capacity: int,
                 put_timeout_s: float, actor_id: str):
        self.buffer, self.weights, self.admission = buffer, weights, admission
        self.metrics, self.stop, self.actor_id = metrics, stop, actor_id
        self.max_groups = max(1, min(MAX_WRITE_GROUPS, capacity))
        self._limit = self.max_groups  # halved by each refusal, so a write always fits in time
        self.put_timeout_s = put_timeout_s
        self._unwritten: collections.deque[_Unwritten] = collections.deque()
        self._writes = asyncio.Semaphore(MAX_WRITES)
        self._full_since: float | None = None  # refused at capacity since (None: not refused)
        self._warned_at = 0.0

    async def put(self, group: Group, lease: Lease | None) -> bool:
        """True once `group` is in the buffer and `lease` (if any) released; False on stop.

        Waits its turn: it joins the next write, which this call makes itself when a write slot
        is free, or another call does.
        Raises:
          BufferError, AdmissionError: the write carrying the group failed.
        """
        mine = _Unwritten(group, lease, asyncio.get_running_loop().create_future())
        self._unwritten.append(mine)
        try:
            while not mine.written.done() and not self.stop.is_set():
                if mine.taken:  # in another call's write: its outcome (or its refusal) first
                    await asyncio.wait([mine.written], timeout=PUT_SLICE_S)
                    continue
                async with self._writes:
                    if not (mine.taken or mine.written.done() or self.stop.is_set()):
                        await self._write_next()
        finally:
            if not mine.taken and not mine.written.done():  # stopped, or cancelled, unwritten
                self._unwritten.remove(mine)
        if not mine.written.done() or mine.written.cancelled():
            return False
        mine.written.result()  # the write's error, if it failed
        return True

    async def _write_next(self) -> None:
        """One write of the oldest unwritten groups; its outcome is theirs (`written`)."""
        batch = [self._unwritten.popleft()
                 for _ in range(min(len(self._unwritten), self._limit))]
        for item in batch:
            item.taken = True
        start = time.perf_counter()
        try:
            await asyncio.to_thread(self._write, batch)
        except BufferFull:
            if self.stop.is_set():  # abandoned (their calls may have returned already)
                for item in batch:
                    item.written.cancel()
                return
            for item in reversed(batch):  # back to the front, in order, for the next write
                item.taken = False
                self._unwritten.appendleft(item)
            self._limit = max(1, len(batch) // 2)  # smaller next time (the module's docstring)
            self._refused()
            return
        except asyncio.CancelledError:  # stopping: the thread may still finish the write
            for item in batch:
                item.written.cancel()
            raise
        except Exception as error:  # each group's own call raises it
            for item in batch:
                item.written.set_exception(error)
            return
        self._full_since, self._limit = None, self.max_groups
        for item in batch:
            item.written.set_result(None)
        self.metrics.observe("actor/put_s", time.perf_counter() - start)
        self.metrics.observe("actor/put_groups", len(batch))

    def _write(self, batch: list[_Unwritten]) -> None:
        """On a pool thread: the version read and the lease release are store calls."""
        version, put_at = self.weights.latest_version(), time.time()
        for item in batch:
            item.group.put_version = version
            for t in item.group.trajectories:
                t.timings["put"] = put_at
        self.buffer.put([item.group for item in batch], PUT_SLICE_S)
        leases = [item.lease for item in batch if item.lease is not None]
        if leases:
            self.admission.release_many(leases)

    def _refused(self) -> None:
        now = time.perf_counter()
        if self._full_since is None:
            self._full_since = self._warned_at = now
        elif now - self._warned_at >= self.put_timeout_s:
            self._warned_at = now
            self.metrics.count("actor/put_timeouts")
            log.warning("actor %s: buffer full for %.0f s; still retrying", self.actor_id,
                        now - self._full_since)
