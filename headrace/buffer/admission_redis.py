"""Admission in Redis, for actors in other processes or on other hosts (docs/design.md, "Scaling out").

Keys of one run and shard, next to the buffer's (the `{RUN:SHARD}` hash tag keeps them in one
Redis Cluster slot with the stream, so one script may read them all):

  headrace:{RUN:SHARD}:admission:learner     hash: version, since_publish, step_s, updated_ms
  headrace:{RUN:SHARD}:admission:handled     hash: learner host -> groups handled, not yet acked
  headrace:{RUN:SHARD}:admission:waiting     hash: learner host -> groups it is blocked waiting for
  headrace:{RUN:SHARD}:admission:leases      sorted set of `actor|id` scored by expiry (server ms)
  headrace:{RUN:SHARD}:admission:actor:ID    set of that actor's lease members (expires with them)

`try_admit` (and `try_admit_many`, for several groups in one round trip) is one Lua script: drop
expired leases, count the live ones, read the learner's state and the stream's counts (the
`learners` group's pending entries: the learner's queue is pending - handled; depth is
`XLEN - pending`), apply the rule of `headrace.buffer.admission.decide` to each group in turn (the
ones admitted before it in flight), and take a lease for each admissible one, so two actors can
never both take the last admissible slot. Lease expiry uses the server's clock (one clock for
every host). A call whose reply was lost is retried with the same lease ids, and the script first
removes them, so a retry never holds two slots for one group.

Failure modes: a lost connection is retried with exponential backoff for at most `retry_s`, then
`AdmissionError`. Values are kept as strings in Redis; floats cross into Lua as Python's `repr`,
which Lua parses exactly, so the script and `decide` agree bit for bit.
"""

from __future__ import annotations

import collections
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis

from headrace.buffer.admission import (
    Admission,
    AdmissionError,
    AdmissionLimits,
    Forecast,
    LearnerState,
    Lease,
    check_name,
    check_update,
    grant,
    new_lease_id,
)
from headrace.buffer.redis_stream import GROUP, call_with_retry, connect
from headrace.config import Config
from headrace.versions import TRAINED_AT_LUA

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: learner, handled, leases, actor set, waiting, stream(s) (every shard on this server). ARGV: stream
# group, reserve ('1'|'0'), count, ttl_ms, weights_version, p90 ('' unknown), groups_per_batch,
# publish_every, max_policy_lag, max_age_s, max_ready_batches, then depth and pending of shards on
# other servers (read just before, outside the script), then `count` lease members. The rule is
# applied to the groups one after another, each admitted one in flight for the next, up to the
# first refusal.
# Returns {reason, version, since_publish, queued, depth, in_flight, step_s, admitted, waiting_for}:
# the state read, the last decision's reason and how many leases were taken.
_DECIDE = _NOW + TRAINED_AT_LUA + """
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local count = tonumber(ARGV[3])
for k = 1, count do  -- this call's own, from an attempt whose reply was lost
  redis.call('ZREM', KEYS[3], ARGV[13 + k])
end
local in_flight = redis.call('ZCARD', KEYS[3])
local learner = redis.call('HMGET', KEYS[1], 'version', 'since_publish', 'step_s')
local version, since = tonumber(learner[1] or '0'), tonumber(learner[2] or '0')
local step_text = learner[3] or '0'
local handled = 0
for _, n in ipairs(redis.call('HVALS', KEYS[2])) do handled = handled + tonumber(n) end
local waiting_for = 0
for _, n in ipairs(redis.call('HVALS', KEYS[5])) do waiting_for = waiting_for + tonumber(n) end
local depth, pending = tonumber(ARGV[12] or '0'), tonumber(ARGV[13] or '0')
for k = 6, #KEYS do
  local summary = redis.pcall('XPENDING', KEYS[k], ARGV[1])
  if not (type(summary) == 'table' and summary.err) then
    pending = pending + summary[1]
    depth = depth + redis.call('XLEN', KEYS[k]) - summary[1]
  end
end
local queued = math.max(0, pending - handled)
local max_age, ttl = tonumber(ARGV[10]), tonumber(ARGV[4])
local max_ready, step_s = tonumber(ARGV[11]), tonumber(step_text)
local reason, admitted = '', 0
for k = 1, count do
  local ahead = queued + depth + in_flight + admitted + 1
  local trained_at, batches = forecast_trained_at(version, since, ahead, tonumber(ARGV[7]),
                                                 tonumber(ARGV[8]))
  if trained_at - tonumber(ARGV[5]) > tonumber(ARGV[9]) then
    reason = 'lag'
  elseif max_ready > 0 and ARGV[6] ~= '' and step_s > 0 and  -- versions.too_many_ready
      batches * step_s > tonumber(ARGV[6]) + max_ready * step_s and
      depth + in_flight + admitted >= waiting_for then  -- else a waiting learner lacks them
    reason = 'ready'
  elseif max_age > 0 and ARGV[6] ~= '' and
      batches * step_s + tonumber(ARGV[6]) > max_age then
    reason = 'age'
  end
  if reason ~= '' or ARGV[2] ~= '1' then break end
  redis.call('ZADD', KEYS[3], now + ttl, ARGV[13 + k])
  redis.call('SADD', KEYS[4], ARGV[13 + k])
  admitted = admitted + 1
end
if admitted > 0 then
  redis.call('PEXPIRE', KEYS[4], ttl)
end
for k = admitted + 1, count do
  redis.call('SREM', KEYS[4], ARGV[13 + k])
end
return {reason, version, since, queued, depth, in_flight, step_text, admitted, waiting_for}
"""

# KEYS: leases, actor set. ARGV: ttl_ms. Returns the number of live leases renewed.
_HEARTBEAT = _NOW + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local ttl, live = tonumber(ARGV[1]), 0
for _, m in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if redis.call('ZSCORE', KEYS[1], m) then
    redis.call('ZADD', KEYS[1], 'XX', now + ttl, m)
    live = live + 1
  else
    redis.call('SREM', KEYS[2], m)
  end
end
if live > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
return live
"""

# KEYS: leases, actor set. ARGV: members (the actor's). Returns how many of them were live.
_RELEASE = _NOW + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local live = 0
for i = 1, #ARGV do
  redis.call('SREM', KEYS[2], ARGV[i])
  live = live + redis.call('ZREM', KEYS[1], ARGV[i])
end
return live
"""

# KEYS: leases, actor set (or none). Returns live leases, of the actor when its set is given.
_COUNT = _NOW + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if #KEYS == 1 then return redis.call('ZCARD', KEYS[1]) end
local live = 0
for _, m in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if redis.call('ZSCORE', KEYS[1], m) then live = live + 1 end
end
return live
"""


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisAdmission(Admission):
    """Admission whose state lives in the run's Redis, shared by every process and host.

    Args:
      client: a `redis://` / `unix://` URL, or a `redis.Redis` (it keeps its own retry policy).
      limits, lease_ttl_s: see `Admission`.
      run_id, shard: name the keys (the same as the run's `RedisBuffer`, whose stream's depth is
        counted).
      local_shards: buffer shards whose streams live on this server (shards shard ..
        shard + local_shards - 1, `buffer.shards`); their depth and pending are read inside the
        decision script, atomically with the leases.
      remote_counts: for shards on other servers (`buffer.urls`), a callable returning their
        total (depth, pending), read just before each decision: a forecast, not atomic with it.
      password: Redis AUTH password (for a URL client).
      retry_s: how long a lost connection is retried before `AdmissionError`.
      socket_timeout_s: a reply slower than this counts as a lost connection.
    Raises:
      ValueError: an argument is out of range.
    """

    def __init__(self, client: str | redis.Redis, limits: AdmissionLimits, *, run_id: str,
                 shard: int = 0, lease_ttl_s: float = 30.0, password: str | None = None,
                 retry_s: float = 30.0, socket_timeout_s: float = 10.0,
                 local_shards: int = 1,
                 remote_counts: Callable[[], tuple[int, int]] | None = None):
        super().__init__(limits, lease_ttl_s)
        if local_shards < 1:
            raise ValueError(f"local_shards={local_shards}: must be >= 1")
        self._remote_counts = remote_counts
        if not run_id or not re.fullmatch(r"[\w.\-]+", run_id):
            raise ValueError(f"run_id={run_id!r}: use letters, digits, '_', '-', '.'")
        if shard < 0 or retry_s < 0 or socket_timeout_s <= 0:
            raise ValueError(f"shard={shard}, retry_s={retry_s} must be >= 0, socket_timeout_s="
                             f"{socket_timeout_s} > 0")
        self.retry_s = retry_s
        self._ttl_ms = max(1, int(round(lease_ttl_s * 1000)))
        self._own_client = isinstance(client, str)
        if isinstance(client, str):
            self._where, self._client = client, connect(client, password, socket_timeout_s)
        else:
            self._where, self._client = repr(client), client
        prefix = f"headrace:{{{run_id}:{shard}}}"
        self.stream_key = f"{prefix}:groups"
        self.stream_keys = [f"headrace:{{{run_id}:{shard + i}}}:groups"
                            for i in range(local_shards)]
        self.prefix = f"{prefix}:admission"
        self.learner_key, self.handled_key = f"{self.prefix}:learner", f"{self.prefix}:handled"
        self.leases_key, self.waiting_key = f"{self.prefix}:leases", f"{self.prefix}:waiting"
        scripts = dict(decide=_DECIDE, heartbeat=_HEARTBEAT, release=_RELEASE, count=_COUNT)
        self._lua = {name: self._client.register_script(src) for name, src in scripts.items()}

    @classmethod
    def from_config(cls, config: Config, url: str, run_id: str, **kwargs: Any) -> RedisAdmission:
        """Admission for `config` at `url` (or `config.buffer.url` when `url` is empty).

        Raises:
          ValueError: neither names a server.
        """
        url = url or config.buffer.url
        if not url:
            raise ValueError("no Redis URL: set buffer.url or pass the embedded server's url")
        return cls(url, AdmissionLimits.from_config(config), run_id=run_id,
                   password=config.buffer.password or None, **kwargs)

    def _actor_key(self, actor_id: str) -> str:
        return f"{self.prefix}:actor:{actor_id}"

    def _call(self, what: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Runs one request, retrying a lost connection with exponential backoff."""
        return call_with_retry(lambda: fn(*args, **kwargs), where=self._where,
                               what=f"admission {what}", retry_s=self.retry_s,
                               error=AdmissionError, auth_hint="set buffer.password")

    def learner_update(self, version: int, since_publish: int, handled: int, step_s: float,
                       host: str = "0", waiting_for: int = 0) -> None:
        check_update(version, since_publish, handled, step_s, waiting_for)
        check_name("host", host)

        def write() -> None:
            pipe = self._client.pipeline(transaction=True)
            pipe.hset(self.learner_key, mapping={
                "version": int(version), "since_publish": int(since_publish),
                "step_s": repr(float(step_s)), "updated_ms": int(time.time() * 1000)})
            pipe.hset(self.handled_key, host, int(handled))
            pipe.hset(self.waiting_key, host, int(waiting_for))
            pipe.execute()

        self._call("learner_update", write)

    def _script(self, actor_id: str, weights_version: int, p90_episode_s: float | None,
                reserve: bool, members: list[str]) -> tuple[str, LearnerState, int, int, int]:
        """Runs the decision script for `len(members)` groups: (the last decision's reason, the
        learner state, depth, in flight before this call, leases taken)."""
        p90 = "" if p90_episode_s is None else repr(float(p90_episode_s))
        lim = self.limits
        remote = self._remote_counts() if self._remote_counts is not None else (0, 0)
        reply = self._call(
            "try_admit" if reserve else "forecast", self._lua["decide"],
            keys=[self.learner_key, self.handled_key, self.leases_key, self._actor_key(actor_id),
                  self.waiting_key, *self.stream_keys],
            args=[GROUP, "1" if reserve else "0", len(members), self._ttl_ms,
                  int(weights_version), p90, lim.groups_per_batch, lim.publish_every,
                  lim.max_policy_lag, repr(float(lim.max_age_s)), lim.max_ready_batches,
                  int(remote[0]), int(remote[1]), *members])
        reason, version, since, queued, depth, in_flight, step_s, admitted, waiting_for = reply
        state = LearnerState(int(version), int(since), int(queued), float(_str(step_s)),
                             int(waiting_for))
        return _str(reason), state, int(depth), int(in_flight), int(admitted)

    def _decide(self, actor_id: str, weights_version: int, p90_episode_s: float | None,
                reserve: bool, count: int = 1) -> tuple[Forecast, list[Lease]]:
        members = [new_lease_id(actor_id) for _ in range(count if reserve else 1)]
        reason, state, depth, in_flight, admitted = self._script(
            actor_id, weights_version, p90_episode_s, reserve, members)
        forecast, leases = grant(actor_id, state, depth, in_flight, self.limits, weights_version,
                                 p90_episode_s, members if reserve else [])
        if forecast.reason != reason or len(leases) != admitted:  # script and rule must agree
            raise AdmissionError(f"admission script decided {reason!r} with {admitted} leases "
                                 f"but the rule says {forecast.reason!r} with {len(leases)} for "
                                 f"{forecast}; a bug, please report it")
        return forecast, leases

    def release(self, lease: Lease) -> bool:
        return self.release_many([lease]) == 1

    def release_many(self, leases: Sequence[Lease]) -> int:
        """One round trip per actor among `leases` (one for an actor's own)."""
        by_actor: dict[str, list[str]] = collections.defaultdict(list)
        for lease in leases:
            by_actor[lease.actor_id].append(lease.lease_id)
        return sum(int(self._call("release", self._lua["release"],
                                  keys=[self.leases_key, self._actor_key(actor_id)], args=ids))
                   for actor_id, ids in by_actor.items())

    def heartbeat(self, actor_id: str) -> int:
        check_name("actor_id", actor_id)
        return int(self._call("heartbeat", self._lua["heartbeat"],
                              keys=[self.leases_key, self._actor_key(actor_id)],
                              args=[self._ttl_ms]))

    def in_flight(self, actor_id: str | None = None) -> int:
        keys = [self.leases_key]
        if actor_id is not None:
            keys.append(self._actor_key(check_name("actor_id", actor_id)))
        return int(self._call("in_flight", self._lua["count"], keys=keys, args=[]))

    def learner_state(self) -> LearnerState:
        """What the learner last reported, with the groups it holds untrained (zeros before
        its first report), as the decision script reads them."""
        return self._script("forecast", 0, None, False, [new_lease_id("forecast")])[1]

    def drop(self) -> None:
        """Deletes this run's admission keys (learner state, leases, per-actor sets)."""
        actors = self._call("drop", lambda: list(
            self._client.scan_iter(match=f"{self.prefix}:actor:*")))
        self._call("drop", self._client.delete, self.learner_key, self.handled_key,
                   self.leases_key, self.waiting_key, *actors)

    def close(self) -> None:
        if self._own_client:
            self._client.close()
