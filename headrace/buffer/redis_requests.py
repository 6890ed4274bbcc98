"""The multi-command requests of `RedisBuffer` (`redis_stream` keeps the state, the retries and
the counts; its docstring states the contract): a put's transaction and the search for it after
a lost reply; a get's reads of its consumer's own pending entries and claims of entries idle in
other consumers' hands, and the decoding of what they read.

Each request that must be atomic is one MULTI/EXEC pipeline, so an entry's delivery count is read
with the entry and a put is all or nothing.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import redis

from headrace.buffer.serialize import UNDECODABLE, MalformedEntry, decode
from headrace.types import Entry, EntryId

GROUP = "learners"  # the consumer group every learner host joins
FIELD = b"group"  # the stream field holding the serialized group
PUT_FIELD = b"put"  # the stream field holding the token of the put that wrote the entry


def str_id(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Read(NamedTuple):
    """Raw stream entries read, with delivery counts where they are not 1."""

    raw: list
    counts: dict[str, int]


class Decoded(NamedTuple):
    entries: list[Entry]
    malformed: list[tuple[EntryId, str, str, bytes]]  # (id, reason, message, bytes) to quarantine
    gone: list[EntryId]  # deleted from the stream while pending: to acknowledge


def write_put(client: redis.Redis, stream_key: str, token: str, encoded: list[bytes], *,
              reserved_key: str, added_key: str, written_key: str | None,
              group_ids: list[str]) -> list[EntryId]:
    """One transaction: the entries (tagged with the put's `token`), the end of its reservation,
    the count of groups ever added and, with a ledger (`written_key`), their group ids."""
    pipe = client.pipeline(transaction=True)
    for data in encoded:
        pipe.xadd(stream_key, {FIELD: data, PUT_FIELD: token})
    pipe.zrem(reserved_key, f"{token}:{len(encoded)}")
    pipe.incrby(added_key, len(encoded))
    if written_key is not None:
        pipe.sadd(written_key, *group_ids)
    return [str_id(i) for i in pipe.execute()[:len(encoded)]]


def find_put(client: redis.Redis, stream_key: str, token: str, since_ms: int) -> list[EntryId]:
    """Ids of the entries the put `token` wrote from `since_ms` on (those still in the stream)."""
    found, start, want = [], f"{since_ms}-0", token.encode()
    while True:
        page = client.xrange(stream_key, start, "+", count=256)
        found += [str_id(i) for i, fields in page if fields.get(PUT_FIELD) == want]
        if len(page) < 256:
            return found
        start = f"({str_id(page[-1][0])}"


def read_own(client: redis.Redis, stream_key: str, consumer: str, cursor: str, max_groups: int,
             holding: Collection[str]) -> tuple[str | None, Read]:
    """(the last id read, or None when nothing was; the entries after `cursor` that `consumer`
    holds pending, less those this instance handed out, `holding`)."""
    pipe = client.pipeline(transaction=True)
    pipe.xpending_range(stream_key, GROUP, f"({cursor}", "+", max_groups, consumername=consumer)
    pipe.xreadgroup(GROUP, consumer, {stream_key: cursor}, count=max_groups)
    before, reply = pipe.execute()
    raw = reply[0][1] if reply else []
    if not raw:
        return None, Read([], {})
    counts = {str_id(p["message_id"]): int(p["times_delivered"]) + 1 for p in before}
    return str_id(raw[-1][0]), Read([(i, f) for i, f in raw if str_id(i) not in holding], counts)


def claim_idle(client: redis.Redis, stream_key: str, consumer: str, idle_ms: int,
               max_groups: int, max_pending: int, holding: Collection[str],
               peers: frozenset[str]) -> Read | None:
    """Claims for `consumer` up to `max_groups` entries idle >= `idle_ms` that neither this
    instance (`holding`) nor a peer consumer holds; None when there is none."""
    peer_names = {p.encode() for p in peers} | set(peers)
    # Enough of the pending list to see past what this instance and its peers hold.
    count = max_groups + len(holding) + (max_pending if peers else 0)
    idle = client.xpending_range(stream_key, GROUP, "-", "+", count, idle=idle_ms)
    ids = [str_id(p["message_id"]) for p in idle if p["consumer"] not in peer_names]
    ids = [i for i in ids if i not in holding][:max_groups]
    if not ids:
        return None
    pipe = client.pipeline(transaction=True)
    pipe.xclaim(stream_key, GROUP, consumer, idle_ms, ids)
    pipe.xpending_range(stream_key, GROUP, ids[0], ids[-1], max_pending + len(ids),
                        consumername=consumer)
    raw, after = pipe.execute()
    counts = {str_id(p["message_id"]): int(p["times_delivered"]) for p in after}
    return Read([e for e in raw if e[0] is not None], counts)


def decode_read(read: Read) -> Decoded:
    """The read entries decoded (delivery count 1 unless `read.counts` says otherwise), with the
    malformed ones and the vanished ones set aside."""
    entries, malformed, gone = [], [], []
    for raw_id, fields in read.raw:
        entry_id = str_id(raw_id)
        if not fields:  # deleted from the stream while pending
            gone.append(entry_id)
            continue
        data = fields.get(FIELD)
        try:
            if data is None:
                raise MalformedEntry(f"entry has no {FIELD.decode()!r} field", UNDECODABLE)
            group = decode(data)  # raises MalformedEntry only
        except MalformedEntry as error:
            malformed.append((entry_id, error.reason, str(error), data or b""))
            continue
        entries.append(Entry(entry_id, group, read.counts.get(entry_id, 1)))
    return Decoded(entries, malformed, gone)
