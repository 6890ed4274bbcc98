"""Buffer shards (docs/design.md, "Scaling out"): several Redis streams that act as one buffer.

`buffer.shards: N` puts N streams on one Redis; `buffer.urls: [...]` puts one on each server. Each
shard is a whole `RedisBuffer` (its own stream, quarantine, reservations, ledger, keys tagged
`{RUN:SHARD}`), so validation, quarantine and the accounting identity hold per shard; the total
is their sum.

Who touches which shard:
  * an actor writes every group to one shard, `shard_of(actor_id, n)`: a stable hash (BLAKE2b of
    the id, not Python's per-process `hash`), so a restarted actor writes where it wrote before
    and any host computes the same map;
  * learner host i of h reads shards i, i+h, i+2h, ... (`read_shards`); with more hosts than
    shards a host reads none and `ShardedBuffer` refuses to be built that way;
  * admission's counters live on shard 0's server (`headrace.buffer.admission_redis`).

Entry ids of a sharded buffer are `S/ID` (S the shard, ID the stream's own id), so `ack` and
`quarantine` reach the stream the entry came from; a one-shard buffer is a plain `RedisBuffer`
and its ids stay plain.

Capacity and `max_pending` bound each shard (as `buffer.capacity` and `buffer.max_pending` say),
so the whole buffer holds up to N times as much. `get` asks its shards in turn, starting after
the one that answered last, so no shard starves; it waits in short slices on each (at most
`SLICE_S`), which bounds how late an entry on another shard is seen while one is empty.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Sequence

import redis

from headrace.buffer.base import LATENCIES, Buffer
from headrace.buffer.redis_stream import RedisBuffer
from headrace.types import Entry, EntryId, Group

SLICE_S = 0.05  # longest wait on one empty shard before the next is asked
_SHARDED_ID = re.compile(r"^(\d+)/(\d+-\d+)$")


def shard_of(actor_id: str, shards: int) -> int:
    """The shard `actor_id` writes to: the same on every host and in every process."""
    if shards < 1:
        raise ValueError(f"shards={shards}: must be >= 1")
    digest = hashlib.blake2b(actor_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def read_shards(host: int, hosts: int, shards: int) -> list[int]:
    """The shards learner host `host` of `hosts` reads: host, host + hosts, ..."""
    if not 0 <= host < hosts:
        raise ValueError(f"host={host} of hosts={hosts}: need 0 <= host < hosts")
    return list(range(host, shards, hosts))


class ShardedBuffer(Buffer):
    """Several `RedisBuffer`s, one per shard, behind the buffer contract.

    Args:
      shards: every shard's buffer, indexed by shard (all of them: counts and stats are totals).
      write: the shard `put` writes to (an actor's `shard_of`); None: this client never writes.
      read: the shards `get` reads (a learner host's `read_shards`); empty: it never reads.
      shared_client: a connection the shards share (one server), closed with the buffer.
    Raises:
      ValueError: `write` or `read` names a shard that is not there.
    """

    def __init__(self, shards: Sequence[RedisBuffer], *, write: int | None = None,
                 read: Sequence[int] = (), shared_client: redis.Redis | None = None):
        self.shards = list(shards)
        n = len(self.shards)
        if n < 1 or (write is not None and not 0 <= write < n) \
                or any(not 0 <= s < n for s in read):
            raise ValueError(f"write={write}, read={list(read)}: shards are 0..{n - 1}")
        self.write, self.read = write, list(read)
        self.consumer = self.shards[0].consumer
        self._shared_client = shared_client
        self._next = 0  # index into `read` of the shard asked first

    # -- routing ------------------------------------------------------------------------------

    def _split(self, entry_id: EntryId) -> tuple[int, EntryId]:
        match = _SHARDED_ID.match(entry_id) if isinstance(entry_id, str) else None
        if match is None or int(match[1]) >= len(self.shards):
            raise ValueError(f"{entry_id!r} is not an entry id of this sharded buffer "
                             f"(SHARD/ID with SHARD < {len(self.shards)}, e.g. '1/1712-0')")
        return int(match[1]), match[2]

    def put(self, groups: Sequence[Group], timeout_s: float) -> list[EntryId]:
        """Writes to this client's shard (all or nothing there); see `RedisBuffer.put`."""
        if self.write is None:
            raise ValueError("this sharded buffer was built without a shard to write to")
        ids = self.shards[self.write].put(groups, timeout_s)
        return [f"{self.write}/{i}" for i in ids]

    def get(self, max_groups: int, timeout_s: float) -> list[Entry]:
        """Entries from the first of this host's shards (in turn) that has any; waits up to
        `timeout_s` in total, at most SLICE_S on each empty shard at a time."""
        if max_groups < 1:
            raise ValueError(f"max_groups={max_groups}: must be >= 1")
        if not self.read:
            raise ValueError("this sharded buffer was built without shards to read")
        deadline = time.monotonic() + timeout_s
        while True:
            for k in range(len(self.read)):
                index = (self._next + k) % len(self.read)
                shard = self.read[index]
                last = k == len(self.read) - 1  # only the last asked waits, briefly
                wait = min(SLICE_S, max(0.0, deadline - time.monotonic())) if last else 0.0
                entries = self.shards[shard].get(max_groups, wait)
                if entries:
                    self._next = (index + 1) % len(self.read)
                    return [Entry(f"{shard}/{e.id}", e.group, e.delivery_count)
                            for e in entries]
            if time.monotonic() >= deadline:
                return []

    def ack(self, ids: Sequence[EntryId]) -> None:
        by_shard: dict[int, list[EntryId]] = {}
        for entry_id in ids:
            index, own = self._split(entry_id)
            by_shard.setdefault(index, []).append(own)
        for index, own_ids in by_shard.items():
            self.shards[index].ack(own_ids)

    def quarantine(self, entry_id: EntryId, reason: str, message: str) -> None:
        index, own = self._split(entry_id)
        self.shards[index].quarantine(own, reason, message)

    def share_with(self, consumers: Sequence[str]) -> None:
        for shard in self.shards:
            shard.share_with(consumers)

    # -- counts and stats (totals over every shard) -------------------------------------------

    def depth(self) -> int:
        return sum(s.depth() for s in self.shards)

    def pending(self) -> int:
        return sum(s.pending() for s in self.shards)

    def stats(self) -> dict[str, float]:
        """The `buffer/*` metrics over every shard: counts and rates summed, latencies the worst
        shard's (this client's), plus `buffer/depth_shard{i}` and `buffer/written_shard{i}`
        (groups ever written to it, by every writer) for each shard."""
        per = [s.stats() for s in self.shards]
        total: dict[str, float] = {}
        for key in per[0]:
            values = [p[key] for p in per]
            total[key] = max(values) if key in LATENCIES else sum(values)
        for i, p in enumerate(per):
            total[f"buffer/depth_shard{i}"] = p["buffer/depth"]
            total[f"buffer/written_shard{i}"] = self.shards[i].added()
        return total

    @property
    def client(self) -> redis.Redis:
        """Shard 0's connection: where the run's metrics and admission live."""
        return self.shards[0].client

    def all_ids(self) -> dict[str, set[EntryId]]:
        """`RedisBuffer.all_ids` of every shard, in sharded ids."""
        out: dict[str, set[EntryId]] = {"undelivered": set(), "pending": set(),
                                        "quarantined": set()}
        for index, shard in enumerate(self.shards):
            for kind, ids in shard.all_ids().items():
                out[kind].update(f"{index}/{i}" for i in ids)
        return out

    def added(self) -> int:
        return sum(s.added() for s in self.shards)

    def written_group_ids(self) -> set[str]:
        return set().union(*(s.written_group_ids() for s in self.shards))

    def drop(self) -> None:
        for shard in self.shards:
            shard.drop()

    def close(self) -> None:
        for shard in self.shards:
            shard.close()
        if self._shared_client is not None:
            self._shared_client.close()
