"""Redis Streams buffer backend: `headrace.buffer.base`'s contract over XADD / XREADGROUP / XACK.

The keys of one run and shard (`headrace:{RUN:SHARD}:groups`, `:quarantine`, `:added`,
`:reserved:put|get`, `:written`, `:ledger`; the hash tag keeps them in one Redis Cluster slot) and
how each part of the contract is kept are docs/buffer.md's. In short: acknowledged entries are
deleted, so `depth = XLEN - pending` exactly; bounds hold across processes through reservations
(small scripts that never see a payload), and a put is one MULTI/EXEC, all or nothing; a put
whose reply was lost is found by its token, not repeated; `get` re-reads its consumer's own
pending entries first (a restart), claims entries idle >= `claim_idle_s` elsewhere, then waits
with a non-consuming `XREAD BLOCK`; malformed entries are quarantined before they are handed out;
with the run's ledger on, each put records its group ids in its own transaction.

One consumer group, `learners`; every learner host is one consumer, named by the caller. The Lua
scripts live in `redis_scripts`, connections and their retry in `redis_client`, the
multi-command requests (a put's transaction, a get's reads and claims) in `redis_requests`.

Failure modes: a lost connection is retried with exponential backoff (each retry logged and counted
in `buffer/reconnects`) for at most `retry_s`, then `BufferError`; retries can extend a call past
its own timeout by up to `retry_s`. A refused password raises `BufferError` at once. A get whose
reply was lost leaves entries pending for this consumer; the next get re-reads them.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis

from headrace.buffer import redis_requests
from headrace.buffer import redis_scripts as lua
from headrace.buffer.base import Buffer, BufferError, BufferFull, stats_record
from headrace.buffer.redis_client import call_with_retry, connect
from headrace.buffer.redis_requests import FIELD, GROUP, str_id
from headrace.buffer.serialize import (
    encode,
    group_id_of,
)
from headrace.config import BufferConfig
from headrace.metrics.core import Distribution, RateMeter
from headrace.types import Entry, EntryId, Group

log = logging.getLogger(__name__)

MIN_REDIS = (6, 2)  # XPENDING IDLE and exclusive ranges
_ID = re.compile(r"^\d+-\d+$")
_T = TypeVar("_T")

def enable_ledger(client: redis.Redis, run_id: str, shard: int = 0) -> None:
    """Turns on the run's ledger of written groups for every buffer client opened afterwards."""
    client.set(f"headrace:{{{run_id}:{shard}}}:ledger", 1)


class RedisBuffer(Buffer):
    """The production buffer: groups in a Redis stream, learners in one consumer group.

    Args:
      client: a `redis://` / `unix://` URL, or a `redis.Redis` built with `decode_responses=False`
        (it keeps its own retry policy; a URL client gets none, so retries are counted here).
      run_id: names the keys, so runs sharing a server never collide.
      consumer: this learner host's consumer name; a restarted learner reuses it to get its
        pending entries back.
      capacity: undelivered entries at most; `put` blocks beyond.
      max_pending: delivered, unacknowledged entries at most (over all consumers).
      claim_idle_s: pending entries idle this long are claimed by a `get`.
      password: Redis AUTH password (for a URL client).
      shard: the stream shard (docs/design.md, "Scaling out").
      retry_s: how long a lost connection is retried before `BufferError`.
      socket_timeout_s: a Redis reply slower than this counts as a lost connection.
      ledger: record written group ids (see the module docstring); None follows the run's flag
        (`enable_ledger`), read once here.
    Raises:
      BufferError: the server cannot be reached within `retry_s`, refuses the password, or is
        older than Redis 6.2.
      ValueError: an argument is out of range.
    """

    def __init__(self, client: str | redis.Redis, *, run_id: str, consumer: str,
                 capacity: int = 64, max_pending: int = 1024, claim_idle_s: float = 60.0,
                 password: str | None = None, shard: int = 0, retry_s: float = 30.0,
                 socket_timeout_s: float = 30.0, ledger: bool | None = None):
        if not run_id or not re.fullmatch(r"[\w.\-]+", run_id):
            raise ValueError(f"run_id={run_id!r}: use letters, digits, '_', '-', '.'")
        if not consumer or any(c.isspace() for c in consumer):
            raise ValueError(f"consumer={consumer!r}: a non-empty name without spaces")
        for name, value in (("capacity", capacity), ("max_pending", max_pending)):
            if value < 1:
                raise ValueError(f"{name}={value}: must be >= 1")
        if claim_idle_s <= 0 or retry_s < 0 or shard < 0 or socket_timeout_s <= 0:
            raise ValueError(f"claim_idle_s={claim_idle_s} and socket_timeout_s="
                             f"{socket_timeout_s} must be > 0, retry_s={retry_s} and "
                             f"shard={shard} >= 0")
        self.capacity, self.max_pending, self.claim_idle_s = capacity, max_pending, claim_idle_s
        self.consumer, self.retry_s = consumer, retry_s
        self._own_client = isinstance(client, str)
        if isinstance(client, str):
            self._where, self._client = client, connect(client, password, socket_timeout_s)
        else:
            if client.get_connection_kwargs().get("decode_responses"):
                raise ValueError("the redis client must use decode_responses=False (payloads are "
                                 "bytes)")
            self._where, self._client = repr(client), client
        self._block_ms_max = int(min(1.0, socket_timeout_s / 2) * 1000)
        prefix = f"headrace:{{{run_id}:{shard}}}"
        self.stream_key, self.quarantine_key = f"{prefix}:groups", f"{prefix}:quarantine"
        self._reasons_key = f"{prefix}:quarantine:reasons"
        self._added_key = f"{prefix}:added"
        self.written_key, self._ledger_flag = f"{prefix}:written", f"{prefix}:ledger"
        self._reserved = {"put": f"{prefix}:reserved:put", "get": f"{prefix}:reserved:get"}
        self._reserve_ttl_ms = int((retry_s + 30.0) * 1000)  # outlives every retry of its call
        scripts = dict(reserve=lua.RESERVE, ack=lua.ACK, quarantine=lua.QUARANTINE,
                       counts=lua.COUNTS, all_ids=lua.ALL_IDS)
        self._lua = {name: self._client.register_script(src) for name, src in scripts.items()}

        self._lock = threading.Lock()
        self._get_lock = threading.Lock()  # one get at a time per instance (cursor, claim clock)
        self._outstanding: set[EntryId] = set()  # handed out by this instance, not acknowledged
        self._peers: frozenset[str] = frozenset()  # consumers never claimed from (`share_with`)
        self._own_cursor: str | None = "0-0"  # re-read own pending entries first (a restart)
        self._claim_every_s = min(claim_idle_s / 2, 1.0)
        self._next_claim = 0.0
        self._redelivered = self._reconnects = 0
        self._put_blocked_s = 0.0
        self._put_ms, self._get_ms = Distribution(), Distribution()
        self._ingest, self._consume = RateMeter(), RateMeter()

        self._check_server()
        self._ensure_group()
        self._added_seen = self._counts()[3]
        if ledger is None:
            ledger = bool(self._call("connect", self._client.exists, self._ledger_flag))
        self.ledger = ledger

    @classmethod
    def from_config(cls, config: BufferConfig, url: str, run_id: str, consumer: str,
                    **kwargs: Any) -> RedisBuffer:
        """A buffer for `config` at `url` (or `config.url` when `url` is empty).

        Raises:
          ValueError: neither `url` nor `config.url` names a server.
        """
        url = url or config.url
        if not url:
            raise ValueError("no Redis URL: set buffer.url, or start a local server with "
                             "headrace.buffer.server.RedisServer and pass its url")
        return cls(url, run_id=run_id, consumer=consumer, capacity=config.capacity,
                   max_pending=config.max_pending, claim_idle_s=config.claim_idle_s,
                   password=config.password or None, **kwargs)

    # -- connection handling ------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Runs one Redis request, retrying a lost connection with exponential backoff."""

        def on_retry() -> None:
            with self._lock:
                self._reconnects += 1
                if what.startswith("get"):
                    self._own_cursor = "0-0"  # a lost reply may have handed us entries

        return call_with_retry(
            lambda: fn(*args, **kwargs), where=self._where, what=what, retry_s=self.retry_s,
            error=BufferError, on_retry=on_retry,
            auth_hint="set buffer.password to the server's requirepass",
            lost_hint="Is redis-server running (its log is in the run folder's redis/)?")

    def _check_server(self) -> None:
        info = self._call("connect", self._client.info, "server")
        version = tuple(int(p) for p in str(info.get("redis_version", "0.0")).split(".")[:2])
        if version < MIN_REDIS:
            raise BufferError(f"Redis at {self._where} is {info.get('redis_version')}; the buffer "
                              f"needs Redis >= {'.'.join(map(str, MIN_REDIS))}")

    def _ensure_group(self) -> None:
        """Creates the stream and the consumer group unless they exist."""
        try:
            self._call("connect", self._client.xgroup_create, self.stream_key, GROUP, id="0",
                       mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise

    def _counts(self, reasons: bool = False) -> list:
        """[xlen, pending, quarantined, added] (and, with `reasons`, quarantined by reason)."""
        keys = [self.stream_key, self.quarantine_key, self._added_key, self._reasons_key]
        *counts, flat = self._call("counts", self._lua["counts"], keys=keys, args=[GROUP])
        counts = [int(v) for v in counts]
        if reasons:
            counts.append({str_id(k): int(v) for k, v in zip(flat[::2], flat[1::2])})
        return counts

    def _reserve(self, kind: str, limit: int, n: int, token: str) -> tuple[int, int, str | None]:
        granted, now_ms, last_id = self._call(
            f"{kind}/reserve", self._lua["reserve"], keys=[self.stream_key, self._reserved[kind]],
            args=[GROUP, kind, limit, n, token, self._reserve_ttl_ms])
        return int(granted), int(now_ms), (str_id(last_id) if last_id else None)

    # -- put ----------------------------------------------------------------------------------

    def put(self, groups: Sequence[Group], timeout_s: float) -> list[EntryId]:
        """Appends groups atomically (all or none) in order; blocks while they would not fit.

        A call fits when `depth + reserved + len(groups) <= max(capacity, len(groups))`, where
        `reserved` counts other puts in flight (a call larger than the capacity goes in alone).

        Raises:
          BufferFull: did not fit within `timeout_s`; nothing of this call was written.
          BufferError: the connection stayed lost for `retry_s`.
        """
        start = time.perf_counter()
        encoded = [encode(g) for g in groups]
        if not encoded:
            return []
        token = uuid.uuid4().hex[:16]
        deadline = time.monotonic() + timeout_s
        blocked_from, delay = None, 0.002
        while True:
            granted, since_ms, _ = self._reserve("put", self.capacity, len(encoded), token)
            if granted:
                break
            blocked_from = blocked_from or time.perf_counter()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                with self._lock:
                    self._put_blocked_s += time.perf_counter() - blocked_from
                raise BufferFull(f"buffer {self.stream_key} stayed at capacity {self.capacity} "
                                 f"for {timeout_s} s")
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.05)
        ids = self._append(token, encoded, since_ms, [g.group_id for g in groups])
        with self._lock:
            if blocked_from is not None:
                self._put_blocked_s += time.perf_counter() - blocked_from
            self._put_ms.add((time.perf_counter() - start) * 1e3)
        return ids

    def _append(self, token: str, encoded: list[bytes], since_ms: int,
                group_ids: list[str]) -> list[EntryId]:
        """Writes a reserved put in one transaction; after a lost reply, finds what it wrote."""
        member, attempts = f"{token}:{len(encoded)}", 0

        def attempt() -> list[EntryId]:
            nonlocal attempts
            attempts += 1
            if attempts > 1 and self._client.zscore(self._reserved["put"], member) is None:
                found = redis_requests.find_put(self._client, self.stream_key, token, since_ms)
                if found:  # the transaction ran; its reply was lost
                    if len(found) < len(encoded):
                        log.warning("put %s: %d of %d entries were consumed before the retry "
                                    "found them", token, len(encoded) - len(found), len(encoded))
                    return found
                log.warning("put %s: reservation and entries lost (server crash?); writing "
                            "again", token)
            return redis_requests.write_put(
                self._client, self.stream_key, token, encoded, reserved_key=self._reserved["put"],
                added_key=self._added_key, written_key=self.written_key if self.ledger else None,
                group_ids=group_ids)

        return self._call("put", attempt)

    def put_raw(self, data: bytes) -> EntryId:
        """Appends bytes as they are, bypassing capacity (tests use it to plant bad entries)."""
        def write() -> list:
            pipe = self._client.pipeline(transaction=True)
            pipe.xadd(self.stream_key, {FIELD: data})
            pipe.incrby(self._added_key, 1)
            return pipe.execute()
        return str_id(self._call("put_raw", write)[0])

    # -- get ----------------------------------------------------------------------------------

    def get(self, max_groups: int, timeout_s: float) -> list[Entry]:
        """Hands out up to `max_groups` entries: own pending ones first (after a restart), then
        claimed idle ones, then new ones in arrival order; waits up to `timeout_s` for any.

        New entries are bounded by `max_pending - pending()` (the call returns fewer, or waits);
        redelivered ones already count as pending. Malformed entries are quarantined and skipped.

        Raises:
          BufferError: the connection stayed lost for `retry_s`.
        """
        if max_groups < 1:
            raise ValueError(f"max_groups={max_groups}: must be >= 1")
        start = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        if not self._get_lock.acquire(timeout=max(timeout_s, 0.0)):
            return []
        try:
            return self._get(max_groups, start, deadline)
        finally:
            self._get_lock.release()

    def _get(self, max_groups: int, start: float, deadline: float) -> list[Entry]:
        delay = 0.002
        while True:
            entries, progressed, last_id = self._get_once(max_groups)
            if entries:
                with self._lock:
                    self._outstanding.update(e.id for e in entries)
                    self._redelivered += sum(e.delivery_count > 1 for e in entries)
                    self._consume.add(len(entries))
                    self._get_ms.add((time.perf_counter() - start) * 1e3)
                return entries
            if progressed:
                continue  # everything read was malformed or gone; look again at once
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            wait = min(remaining, max(self._next_claim - time.monotonic(), 0.001))
            if last_id is None:  # no room (max_pending) or others reserved it: poll
                time.sleep(min(wait, delay))
                delay = min(delay * 2, 0.1)
            else:  # wait for an entry after the group's last delivered one, consuming nothing
                block_ms = max(1, min(int(wait * 1000), self._block_ms_max))
                self._call("get/wait", self._client.xread, {self.stream_key: last_id},
                           count=1, block=block_ms)

    def _get_once(self, max_groups: int) -> tuple[list[Entry], bool, str | None]:
        """One attempt: (entries, whether anything was read, last delivered id when empty)."""
        try:
            if self._own_cursor is not None:
                entries, read = self._call("get/own", self._read_own, max_groups)
                if read:
                    return entries, True, None
                self._own_cursor = None
            if time.monotonic() >= self._next_claim:
                self._next_claim = time.monotonic() + self._claim_every_s
                entries, read = self._call("get/claim", self._claim, max_groups)
                if read:
                    return entries, True, None
        except redis.ResponseError as error:
            if "NOGROUP" not in str(error):
                raise
            self._ensure_group()  # the stream vanished (dropped, flushed): start it again
            self._own_cursor = None
        token = uuid.uuid4().hex[:16]
        granted, _, last_id = self._reserve("get", self.max_pending, max_groups, token)
        if not granted:
            return [], False, last_id

        def read_new() -> list:
            pipe = self._client.pipeline(transaction=True)
            pipe.xreadgroup(GROUP, self.consumer, {self.stream_key: ">"}, count=granted)
            pipe.zrem(self._reserved["get"], f"{token}:{granted}")
            return pipe.execute()[0]

        reply = self._call("get/new", read_new)
        raw = reply[0][1] if reply else []
        return self._deliver(redis_requests.Read(raw, {})), bool(raw), None

    def _read_own(self, max_groups: int) -> tuple[list[Entry], bool]:
        """Own pending entries after the cursor, with delivery counts (read atomically)."""
        with self._lock:
            holding = set(self._outstanding)
        last, read = redis_requests.read_own(self._client, self.stream_key, self.consumer,
                                          self._own_cursor or "0-0", max_groups, holding)
        if last is None:
            return [], False
        self._own_cursor = last
        return self._deliver(read), True

    def share_with(self, consumers: Sequence[str]) -> None:
        self._peers = frozenset(c for c in consumers if c and c != self.consumer)

    def _claim(self, max_groups: int) -> tuple[list[Entry], bool]:
        """Claims entries idle >= claim_idle_s that neither this instance nor a peer of it
        (`share_with`) holds."""
        with self._lock:
            holding = set(self._outstanding)
        read = redis_requests.claim_idle(self._client, self.stream_key, self.consumer,
                                      int(self.claim_idle_s * 1000), max_groups,
                                      self.max_pending, holding, self._peers)
        return ([], False) if read is None else (self._deliver(read), True)

    def _deliver(self, read: redis_requests.Read) -> list[Entry]:
        """Decodes read entries; quarantines malformed ones and acknowledges vanished ones."""
        decoded = redis_requests.decode_read(read)
        for entry_id, reason, message, data in decoded.malformed:
            self._quarantine(entry_id, reason, message, data)
        if decoded.gone:
            self._call("ack", self._lua["ack"], keys=[self.stream_key],
                       args=[GROUP, *decoded.gone])
        return decoded.entries

    def _quarantine(self, entry_id: EntryId, reason: str, message: str,
                    data: bytes | None = None) -> bool:
        group_id = group_id_of(data) if data is not None else None
        args = [GROUP, entry_id, reason, message, self.consumer, group_id or ""]
        args += [data] if data is not None else []  # else read on the server
        moved = self._call("quarantine", self._lua["quarantine"],
                           keys=[self.stream_key, self.quarantine_key, self._reasons_key],
                           args=args)
        if moved:
            log.warning("quarantined malformed entry %s of %s (%s): %s", entry_id,
                        self.stream_key, reason, message)
        return bool(moved)

    def quarantine(self, entry_id: EntryId, reason: str, message: str) -> None:
        """Moves a pending entry (its bytes read on the server) to the quarantine stream."""
        if self._quarantine(entry_id, reason, message):
            with self._lock:
                self._outstanding.discard(entry_id)

    # -- ack, counts, stats -------------------------------------------------------------------

    def ack(self, ids: Sequence[EntryId]) -> None:
        """Acknowledges and deletes entries; ids that are not pending are ignored (idempotent).

        Raises:
          ValueError: an id is not a stream id (`<ms>-<seq>`).
        """
        ids = list(ids)
        for entry_id in ids:
            if not isinstance(entry_id, str) or not _ID.match(entry_id):
                raise ValueError(f"ack: {entry_id!r} is not a stream entry id like '1712-0'")
        if ids:
            self._call("ack", self._lua["ack"], keys=[self.stream_key], args=[GROUP, *ids])
        with self._lock:
            self._outstanding.difference_update(ids)

    def depth(self) -> int:
        xlen, pending, _, _ = self._counts()
        return xlen - pending

    def pending(self) -> int:
        return self._counts()[1]

    def stats(self) -> dict[str, float]:
        """The `buffer/*` metrics plus `buffer/reconnects`.

        Depth, pending, quarantined and `ingest_per_s` are the server's (all writers); latencies,
        `consume_per_s`, `put_blocked_s`, `redelivered` and `reconnects` are this client's.
        """
        xlen, pending, quarantined, added, reasons = self._counts(reasons=True)
        with self._lock:
            self._ingest.add(max(added - self._added_seen, 0))
            self._added_seen = added
            return {**stats_record(
                depth=xlen - pending, pending=pending, ingest_per_s=self._ingest.rate(),
                consume_per_s=self._consume.rate(), put_ms=self._put_ms, get_ms=self._get_ms,
                put_blocked_s=self._put_blocked_s, redelivered=self._redelivered,
                quarantined=quarantined, reasons=reasons), "buffer/reconnects": self._reconnects}

    @property
    def client(self) -> redis.Redis:
        """The connection, for other run state kept in the same Redis (metrics, admission)."""
        return self._client

    def all_ids(self) -> dict[str, set[EntryId]]:
        """One atomic snapshot of every entry id, for accounting checks (slow on a full buffer).

        Returns:
          `undelivered` (in the stream, never delivered), `pending` (delivered, unacknowledged)
          and `quarantined` (the original ids of quarantined entries).
        """
        stream, pending, quarantined = self._call(
            "all_ids", self._lua["all_ids"], keys=[self.stream_key, self.quarantine_key],
            args=[GROUP])
        stream, pending = {str_id(i) for i in stream}, {str_id(i) for i in pending}
        return {"undelivered": stream - pending, "pending": pending,
                "quarantined": {str_id(i) for i in quarantined}}

    def added(self) -> int:
        """Groups ever written to this run's stream, by every writer."""
        return self._counts()[3]

    def written_group_ids(self) -> set[str]:
        """Group ids of every group written while the run's ledger was on (see `ledger`)."""
        return {str_id(g) for g in self._call("written", self._client.smembers, self.written_key)}

    def drop(self) -> None:
        """Deletes this run's stream, quarantine, counters, reservations and ledger, for good."""
        self._call("drop", self._client.delete, self.stream_key, self.quarantine_key,
                   self._reasons_key, self._added_key, self.written_key, self._ledger_flag,
                   *self._reserved.values())
        with self._lock:
            self._outstanding.clear()

    def close(self) -> None:
        """Closes the connection pool when this buffer made it; entries stay on the server."""
        if self._own_client:
            self._client.close()
