"""The buffer contract (docs/design.md, "Buffer contract") as one suite run against every backend.

A `Harness` hides the few things a test cannot do the same way on both backends: restarting the
consumer (memory: `restart_consumer()`; Redis: a new `RedisBuffer` with the same consumer name),
reaching the consumer that claims idle entries (memory: the same buffer; Redis: another consumer)
and planting raw bytes (memory: `put_raw`; Redis: a raw XADD).

`sharded` is the Redis backend over two shards on one server (`headrace.buffer.sharded`): the
client writes to the shard its name hashes to and reads both, so it must keep the same contract.
"""

from __future__ import annotations

import threading
import time

import msgpack
import pytest

from headrace.buffer import BufferFull, MemoryBuffer
from headrace.buffer.redis_stream import FIELD, GROUP, RedisBuffer
from headrace.buffer.serialize import QUARANTINE_REASONS, encode
from headrace.buffer.sharded import ShardedBuffer

STATS_KEYS = {
    "buffer/depth", "buffer/pending", "buffer/ingest_per_s", "buffer/consume_per_s",
    "buffer/put_ms_p50", "buffer/put_ms_p99", "buffer/get_ms_p99", "buffer/put_blocked_s",
    "buffer/redelivered", "buffer/quarantined",
    *(f"buffer/quarantined_{reason}" for reason in QUARANTINE_REASONS),
}


class Harness:
    def __init__(self, kind: str, request):
        self.kind = kind
        self._request = request
        self._opened: list = []
        self._params: dict = {}
        self._url = self._run_id = ""

    def make(self, capacity: int = 64, max_pending: int = 1024, claim_idle_s: float = 60.0):
        self._params = dict(capacity=capacity, max_pending=max_pending, claim_idle_s=claim_idle_s)
        if self.kind == "memory":
            buffer = MemoryBuffer(**self._params)
        else:
            server = self._request.getfixturevalue("redis_server")
            self._url, self._run_id = server.url, self._request.getfixturevalue("run_id")
            buffer = self._redis("learner0")
        self._opened.append(buffer)
        return buffer

    def _redis(self, consumer: str) -> RedisBuffer | ShardedBuffer:
        if self.kind == "sharded":
            from headrace.buffer.sharded import shard_of

            shards = [RedisBuffer(self._url, run_id=self._run_id, consumer=consumer, shard=i,
                                  **self._params) for i in range(2)]
            buffer = ShardedBuffer(shards, write=shard_of(consumer, 2), read=[0, 1])
        else:
            buffer = RedisBuffer(self._url, run_id=self._run_id, consumer=consumer,
                                 **self._params)
        self._opened.append(buffer)
        return buffer

    @staticmethod
    def _stream(buffer) -> tuple[RedisBuffer, str]:
        """The Redis stream entries are written to, and the prefix of their ids."""
        if isinstance(buffer, ShardedBuffer):
            return buffer.shards[buffer.write], f"{buffer.write}/"
        return buffer, ""

    def restart(self, buffer):
        """The same consumer, restarted: its unacknowledged entries come back."""
        if self.kind == "memory":
            buffer.restart_consumer()
            return buffer
        buffer.close()
        return self._redis(buffer.consumer)

    def claimer(self, buffer):
        """The consumer that picks up entries idle for claim_idle_s."""
        return buffer if self.kind == "memory" else self._redis("learner1")

    def plant(self, buffer, data: bytes) -> str:
        if self.kind == "memory":
            return buffer.put_raw(data)
        shard, prefix = self._stream(buffer)
        client = self._request.getfixturevalue("redis_server").client()
        try:
            return prefix + client.xadd(shard.stream_key, {FIELD: data}).decode()
        finally:
            client.close()

    def quarantined(self, buffer) -> dict[str, tuple[bytes, str]]:
        """id -> (bytes, reason) of every quarantined entry, as kept by the backend."""
        if self.kind == "memory":
            return {i: (data, reason) for i, (data, reason, _) in buffer.quarantined.items()}
        shard, prefix = self._stream(buffer)
        client = self._request.getfixturevalue("redis_server").client()
        try:
            return {prefix + f[b"id"].decode(): (f[b"group"], f[b"kind"].decode())
                    for _, f in client.xrange(shard.quarantine_key)}
        finally:
            client.close()

    def hold_raw(self, buffer, count: int) -> None:
        """Delivers `count` entries to the buffer's consumer without decoding them, as a learner
        that died on an entry leaves them (Redis; the memory buffer decodes as it delivers)."""
        shard, _ = self._stream(buffer)
        client = self._request.getfixturevalue("redis_server").client()
        try:
            client.xreadgroup(GROUP, buffer.consumer, {shard.stream_key: ">"}, count=count)
        finally:
            client.close()

    def close(self) -> None:
        for buffer in self._opened:
            buffer.close()


@pytest.fixture(params=["memory", "redis", "sharded"])
def harness(request):
    h = Harness(request.param, request)
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def make_group(group_factory):
    return group_factory


def ids_of(entries) -> list[str]:
    return [e.id for e in entries]


@pytest.mark.timeout(20)
def test_put_get_ack_in_order(harness, make_group):
    buffer = harness.make()
    groups = [make_group(i) for i in range(5)]
    ids = buffer.put(groups, timeout_s=1)
    assert len(ids) == len(set(ids)) == 5
    assert buffer.depth() == 5 and buffer.pending() == 0
    entries = buffer.get(10, timeout_s=1)
    assert ids_of(entries) == ids
    assert [e.group.group_id for e in entries] == [g.group_id for g in groups]
    assert all(e.delivery_count == 1 for e in entries)
    got = entries[3].group
    assert got.trajectories[1].tokens.tolist() == groups[3].trajectories[1].tokens.tolist()
    assert got.put_version == 3
    assert buffer.depth() == 0 and buffer.pending() == 5
    buffer.ack(ids[:3])
    assert buffer.pending() == 2
    buffer.ack(ids[:3])  # acknowledging twice changes nothing
    assert buffer.pending() == 2
    buffer.ack(ids[3:])
    assert buffer.depth() == 0 and buffer.pending() == 0
    assert buffer.get(10, timeout_s=0) == []


@pytest.mark.timeout(20)
def test_get_respects_max_groups_and_arrival_order_across_puts(harness, make_group):
    buffer = harness.make()
    first = buffer.put([make_group(0), make_group(1)], timeout_s=1)
    second = buffer.put([make_group(2)], timeout_s=1)
    assert ids_of(buffer.get(2, timeout_s=1)) == first
    assert ids_of(buffer.get(2, timeout_s=1)) == second


@pytest.mark.timeout(20)
def test_put_blocks_at_capacity_then_raises_buffer_full_writing_nothing(harness, make_group):
    buffer = harness.make(capacity=3)
    buffer.put([make_group(i) for i in range(3)], timeout_s=1)
    start = time.monotonic()
    with pytest.raises(BufferFull):
        buffer.put([make_group(9)], timeout_s=0.3)
    assert time.monotonic() - start >= 0.29
    assert len(buffer.get(1, timeout_s=1)) == 1
    with pytest.raises(BufferFull):  # would not fit although depth < capacity: all or nothing
        buffer.put([make_group(10), make_group(11)], timeout_s=0.1)
    assert buffer.depth() == 2 and buffer.pending() == 1
    assert buffer.stats()["buffer/put_blocked_s"] >= 0.3


@pytest.mark.timeout(20)
def test_batch_larger_than_capacity_goes_into_an_empty_buffer(harness, make_group):
    buffer = harness.make(capacity=2)
    assert len(buffer.put([make_group(i) for i in range(5)], timeout_s=1)) == 5
    assert buffer.depth() == 5


@pytest.mark.timeout(20)
def test_blocked_put_proceeds_when_a_get_frees_room(harness, make_group):
    buffer = harness.make(capacity=2)
    buffer.put([make_group(0), make_group(1)], timeout_s=1)
    got = []
    reader = threading.Timer(0.3, lambda: got.extend(buffer.get(1, timeout_s=1)))
    reader.start()
    try:
        start = time.monotonic()
        ids = buffer.put([make_group(2)], timeout_s=10)
        waited = time.monotonic() - start
    finally:
        reader.join(5)
    assert len(ids) == 1 and len(got) == 1
    assert 0.25 <= waited < 5
    assert buffer.depth() == 2


@pytest.mark.timeout(20)
def test_get_times_out_with_nothing(harness, make_group):
    buffer = harness.make()
    start = time.monotonic()
    assert buffer.get(4, timeout_s=0.3) == []
    assert 0.29 <= time.monotonic() - start < 3


@pytest.mark.timeout(20)
def test_get_wakes_up_when_a_put_arrives(harness, make_group):
    buffer = harness.make()
    writer = threading.Timer(0.2, lambda: buffer.put([make_group(0)], timeout_s=1))
    writer.start()
    try:
        start = time.monotonic()
        entries = buffer.get(4, timeout_s=5)
        waited = time.monotonic() - start
    finally:
        writer.join(5)
    assert len(entries) == 1 and 0.15 <= waited < 2


@pytest.mark.timeout(20)
def test_max_pending_bounds_delivery(harness, make_group):
    buffer = harness.make(max_pending=3)
    ids = buffer.put([make_group(i) for i in range(5)], timeout_s=1)
    assert ids_of(buffer.get(10, timeout_s=1)) == ids[:3]
    assert buffer.pending() == 3
    start = time.monotonic()
    assert buffer.get(10, timeout_s=0.2) == []  # waits: no room
    assert time.monotonic() - start >= 0.19
    buffer.ack(ids[:1])
    assert ids_of(buffer.get(10, timeout_s=1)) == ids[3:4]
    assert buffer.pending() == 3 and buffer.depth() == 1


@pytest.mark.timeout(20)
def test_restarted_consumer_gets_its_unacknowledged_entries_again(harness, make_group):
    buffer = harness.make()
    ids = buffer.put([make_group(i) for i in range(3)], timeout_s=1)
    first = buffer.get(2, timeout_s=1)
    buffer.ack([first[0].id])
    restarted = harness.restart(buffer)
    again = restarted.get(10, timeout_s=1)
    assert ids_of(again)[:1] == ids[1:2] and again[0].delivery_count == 2
    assert again[0].group.group_id == "g1"
    rest = again[1:] or restarted.get(10, timeout_s=1)
    assert ids_of(rest) == ids[2:] and rest[0].delivery_count == 1
    assert restarted.stats()["buffer/redelivered"] == 1
    assert restarted.pending() == 2 and restarted.depth() == 0


@pytest.mark.timeout(20)
def test_idle_pending_entries_are_claimed_after_claim_idle_s(harness, make_group):
    # 2 s: making the claimer and its first gets must not outlast it on a loaded machine, or the
    # held entry is claimed too soon.
    idle_s = 2.0
    buffer = harness.make(claim_idle_s=idle_s)
    ids = buffer.put([make_group(0), make_group(1)], timeout_s=1)
    before_held = time.monotonic()  # the held entry is delivered after this
    held = buffer.get(1, timeout_s=1)
    assert ids_of(held) == ids[:1]
    claimer = harness.claimer(buffer)
    assert ids_of(claimer.get(1, timeout_s=1)) == ids[1:]  # the idle one is not yet taken
    claimer.ack(ids[1:])
    assert claimer.get(1, timeout_s=0.1) == []
    claimed = claimer.get(1, timeout_s=10)  # idle_s, then the next claim round (Redis: 1 s)
    assert time.monotonic() - before_held >= idle_s - 0.05  # not before it was idle that long
    assert ids_of(claimed) == ids[:1] and claimed[0].delivery_count == 2
    assert claimer.stats()["buffer/redelivered"] == 1
    assert claimer.pending() == 1


@pytest.mark.timeout(20)
def test_malformed_entry_is_quarantined_and_neighbours_delivered(harness, make_group):
    buffer = harness.make()
    before = buffer.put([make_group(0)], timeout_s=1)
    harness.plant(buffer, b"\x93not a group")
    harness.plant(buffer, make_group(5).group_id.encode())
    after = buffer.put([make_group(1)], timeout_s=1)
    entries = buffer.get(10, timeout_s=1)
    assert ids_of(entries) == before + after
    assert buffer.stats()["buffer/quarantined"] == 2
    assert buffer.depth() == 0 and buffer.pending() == 2


@pytest.mark.timeout(20)
def test_stats_keys_and_values(harness, make_group):
    buffer = harness.make(capacity=8)
    buffer.put([make_group(i) for i in range(4)], timeout_s=1)
    buffer.ack(ids_of(buffer.get(2, timeout_s=1)))
    stats = buffer.stats()
    assert STATS_KEYS <= set(stats)
    assert all(isinstance(v, (int, float)) for v in stats.values())
    assert stats["buffer/depth"] == 2 and stats["buffer/pending"] == 0
    assert stats["buffer/ingest_per_s"] > 0 and stats["buffer/consume_per_s"] > 0
    assert stats["buffer/put_ms_p99"] >= stats["buffer/put_ms_p50"] > 0
    assert stats["buffer/get_ms_p99"] > 0
    assert stats["buffer/redelivered"] == 0 and stats["buffer/quarantined"] == 0


@pytest.mark.timeout(30)
def test_concurrent_writers_never_exceed_capacity_and_lose_nothing(harness, make_group):
    buffer = harness.make(capacity=5)
    written: list[str] = []
    lock = threading.Lock()

    def write(k: int) -> None:
        for i in range(10):
            ids = buffer.put([make_group(100 * k + i)], timeout_s=10)
            with lock:
                written.extend(ids)

    writers = [threading.Thread(target=write, args=(k,)) for k in range(3)]
    for w in writers:
        w.start()
    seen, max_depth = [], 0
    deadline = time.monotonic() + 15
    while len(seen) < 30 and time.monotonic() < deadline:
        max_depth = max(max_depth, buffer.depth())
        entries = buffer.get(2, timeout_s=0.5)
        seen.extend(ids_of(entries))
        buffer.ack(ids_of(entries))
    for w in writers:
        w.join(5)
    assert max_depth <= 5
    assert sorted(seen) == sorted(written) and len(set(seen)) == 30


def _bad_value(group, path: tuple, value) -> bytes:
    """The group's bytes with one field set to `value`."""
    record = msgpack.unpackb(encode(group), raw=False)
    node = record
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return msgpack.packb(record, use_bin_type=True)


BAD_VALUES = [  # (path, value, reason); each crashed or poisoned the learner before
    (("group", "put_version"), float("inf"), "non_finite"),  # killed the reader thread
    (("trajectories", 0, "reward"), "abc", "type"),  # crashed the batcher
    (("trajectories", 0, "timings"), {"started": float("nan")}, "non_finite"),
]


@pytest.mark.timeout(20)
def test_bad_values_are_quarantined_by_reason_and_kept(harness, make_group):
    buffer = harness.make()
    before = buffer.put([make_group(0)], timeout_s=1)
    bad = {harness.plant(buffer, _bad_value(make_group(9 + k), path, value)): reason
           for k, (path, value, reason) in enumerate(BAD_VALUES)}
    after = buffer.put([make_group(1)], timeout_s=1)
    entries = []
    while len(entries) < 2:
        entries += buffer.get(10, timeout_s=1)
    assert ids_of(entries) == before + after
    kept = harness.quarantined(buffer)
    assert {i: reason for i, (_, reason) in kept.items()} == bad  # moved aside, not lost
    assert all(data.startswith(b"\x83") for data, _ in kept.values())  # the bytes, as written
    stats = buffer.stats()
    assert stats["buffer/quarantined"] == 3
    assert stats["buffer/quarantined_non_finite"] == 2 and stats["buffer/quarantined_type"] == 1
    buffer.ack(ids_of(entries))
    restarted = harness.restart(buffer)
    assert restarted.get(10, timeout_s=0.3) == [] and restarted.depth() == 0  # never redelivered


@pytest.mark.timeout(20)
def test_a_consumer_quarantines_a_delivered_entry_and_it_never_comes_back(harness, make_group):
    buffer = harness.make(claim_idle_s=0.2)
    ids = buffer.put([make_group(0), make_group(1)], timeout_s=1)
    entries = buffer.get(2, timeout_s=1)
    buffer.quarantine(ids[0], "token_id", "token id 70 >= the model's vocabulary 64")
    buffer.quarantine(ids[0], "token_id", "again")  # idempotent
    assert buffer.pending() == 1
    kept = harness.quarantined(buffer)
    assert kept == {ids[0]: (encode(entries[0].group), "token_id")}
    stats = buffer.stats()
    assert stats["buffer/quarantined"] == 1 and stats["buffer/quarantined_token_id"] == 1
    time.sleep(0.3)  # past claim_idle_s: only the other entry may come back
    claimed = harness.claimer(buffer).get(10, timeout_s=1)
    assert ids_of(claimed) == ids[1:]


@pytest.mark.timeout(20)
def test_a_poison_entry_left_pending_is_quarantined_when_the_consumer_restarts(harness,
                                                                                make_group):
    """A learner that died holding a bad entry: its restart re-reads the entry and quarantines
    it instead of dying on it again (the memory buffer never hands one out undecoded)."""
    if harness.kind == "memory":
        pytest.skip("the memory buffer decodes as it delivers: nothing is held undecoded")
    buffer = harness.make()
    bad = harness.plant(buffer, _bad_value(make_group(9), ("group", "put_version"),
                                           float("inf")))
    good = buffer.put([make_group(1)], timeout_s=1)
    harness.hold_raw(buffer, 2)  # both pending at this consumer, as the dead learner left them
    restarted = harness.restart(buffer)
    entries = restarted.get(10, timeout_s=1)
    assert ids_of(entries) == good and entries[0].delivery_count == 2
    assert set(harness.quarantined(restarted)) == {bad}
    assert restarted.pending() == 1
