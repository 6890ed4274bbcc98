"""The Redis weight store's own guarantees (the contract is in test_store.py): pointer last,
chunked streaming in bounded memory, checksums and validated manifests, crash leftovers, and the
embedded server's restricted client user."""

from __future__ import annotations

import json
import threading
import tracemalloc
import uuid

import numpy as np
import pytest

from headrace.config import ConfigError, load
from headrace.runtime import build
from headrace.weights import CorruptWeights, VersionGone
from headrace.weights.redis_store import MANIFEST, RedisWeightStore
from tests.weights.test_store import assert_same, make_params


@pytest.fixture
def store(redis_server):
    made = RedisWeightStore(redis_server.url, f"t-{uuid.uuid4().hex[:12]}", keep=2,
                            chunk_bytes=64)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def admin(redis_server):
    client = redis_server.client()
    try:
        yield client
    finally:
        client.close()


def _manifest(admin, store, version) -> dict:
    return json.loads(admin.hget(store.version_key(version), MANIFEST))


@pytest.mark.timeout(60)
def test_the_pointer_moves_after_every_chunk_and_the_manifest(store, redis_server):
    """Every write of a version reaches the server before the SET of the pointer (seen through
    MONITOR, the server's own order of execution); pruning comes after it."""
    store.publish(make_params(0), 0)
    store.publish(make_params(1), 1)
    commands: list[str] = []
    ready = threading.Event()

    def watch():
        with redis_server.client().monitor() as monitor:
            ready.set()
            for event in monitor.listen():
                commands.append(event["command"])
                if event["command"].startswith("UNLINK") and "v0" in event["command"]:
                    return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert ready.wait(10)
    store.publish(make_params(2), 2)
    watcher.join(timeout=30)
    assert not watcher.is_alive()
    ours = [c for c in commands if store.namespace in c]
    pointer = next(i for i, c in enumerate(ours) if c.startswith("SET") and "latest" in c)
    writes = [i for i, c in enumerate(ours) if c.startswith("HSET") and ":v2" in c]
    chunks = sum(1 for i in writes if MANIFEST not in ours[i])
    assert chunks == sum(-(-a.nbytes // 64) for a in make_params(2).values())  # all chunked
    assert writes and max(writes) < pointer
    assert MANIFEST in ours[max(writes)]  # the manifest is the last write before the pointer
    assert any(c.startswith("UNLINK") and ":v0" in c for c in ours[pointer:])


def test_arrays_are_split_into_bounded_chunks(store, admin):
    params = make_params(3)
    store.publish(params, 3)
    manifest = _manifest(admin, store, 3)
    assert manifest["chunk_bytes"] == 64
    for record in manifest["arrays"]:
        sizes = [admin.hstrlen(store.version_key(3), f"{record['field']}:{i}")
                 for i in range(record["chunks"])]
        assert sum(sizes) == record["nbytes"] and all(0 < s <= 64 for s in sizes)
    assert store.last_publish_bytes == sum(a.nbytes for a in params.values())
    store.load(3)
    assert store.last_load_bytes == store.last_publish_bytes


@pytest.mark.timeout(60)
def test_memory_stays_bounded_while_streaming(redis_server):
    """Publishing adds a few chunks to the caller's arrays, loading the array it fills plus a few
    chunks: never a second copy of the model (the bytes objects of an MGET-all, a tobytes())."""
    mib = 1 << 20
    store = RedisWeightStore(redis_server.url, f"t-{uuid.uuid4().hex[:12]}", chunk_bytes=mib)
    try:
        params = {"big": np.random.default_rng(0).standard_normal(8 * mib).astype(np.float32)}
        size = params["big"].nbytes  # 32 MiB
        tracemalloc.start()
        store.publish(params, 0)
        publish_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        loaded = store.load(0)
        load_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        np.testing.assert_array_equal(loaded["big"], params["big"])
        slack = 4 * mib  # the pipeline's chunks and the client's buffers
        assert publish_peak < 4 * mib + slack, publish_peak / mib
        assert load_peak < size + 4 * mib + slack, load_peak / mib
    finally:
        store.close()


def test_corruption_is_detected(store, admin):
    store.publish(make_params(0), 0)
    key = store.version_key(0)
    record = next(r for r in _manifest(admin, store, 0)["arrays"] if r["path"] == "embed.table")
    field = f"{record['field']}:1"
    data = bytearray(admin.hget(key, field))
    data[5] ^= 0x01  # one flipped bit, same size
    admin.hset(key, field, bytes(data))
    with pytest.raises(CorruptWeights, match="embed.table.*crc32"):
        store.load(0)
    admin.hset(key, field, bytes(data[:-4]))
    with pytest.raises(CorruptWeights, match="embed.table.*not 64"):
        store.load(0)
    admin.hdel(key, field)
    with pytest.raises(CorruptWeights, match="chunk 1 of parameter 'embed.table' is missing"):
        store.load(0)
    admin.hset(key, MANIFEST, "{not json")
    with pytest.raises(CorruptWeights, match="manifest"):
        store.load(0)
    admin.set(store.pointer_key, "garbage")
    with pytest.raises(CorruptWeights, match="not a version number"):
        store.latest_version()


@pytest.mark.parametrize("forged", ["00001", "a:b", "../x", "x/y", "", "..", MANIFEST, 7, None,
                                    "CHUNKS", "BYTES", "DTYPE"])
def test_forged_manifests_are_refused_before_a_chunk_is_read(store, admin, forged):
    store.publish(make_params(0), 0)
    manifest = _manifest(admin, store, 0)
    record = next(r for r in manifest["arrays"] if r["path"] == "embed.table")
    if forged == "CHUNKS":
        record["chunks"] += 1
        match = "chunks"
    elif forged == "BYTES":
        record["nbytes"] += 4
        match = "claims"
    elif forged == "DTYPE":
        record["dtype"] = "object"
        match = "malformed"
    else:
        record["field"] = forged  # "00001" is the next array's: that one is then refused
        match = ("layers.0.attn.q.kernel" if forged == "00001" else "embed.table") + \
            ".*not a plain, unique name"
    admin.hset(store.version_key(0), MANIFEST, json.dumps(manifest))
    with pytest.raises(CorruptWeights, match=match):
        store.load(0)


def test_a_crashed_publish_is_never_seen_and_is_cleaned_up(store, admin, monkeypatch):
    store.publish(make_params(0), 0)
    calls = [0]
    real = store._write_array

    def crash(*args):
        calls[0] += 1
        if calls[0] == 3:
            raise ConnectionError("simulated crash while streaming")
        return real(*args)

    monkeypatch.setattr(store, "_write_array", crash)
    with pytest.raises(ConnectionError, match="simulated"):
        store.publish(make_params(5), 5)
    monkeypatch.undo()
    assert admin.exists(store.version_key(5))  # partial chunks of v5 are there...
    assert store.latest_version() == 0  # ...but the pointer never moved
    with pytest.raises(VersionGone):
        store.load(5)
    store.publish(make_params(1), 1)  # the restarted publisher goes on from 1
    assert not admin.exists(store.version_key(5))  # the leftover above the pointer is gone
    assert store.versions() == [0, 1]
    assert_same(store.load(1), make_params(1))


def test_pruned_versions_are_gone_and_pickups_are_shared(store, redis_server):
    for version in range(4):
        store.publish(make_params(version), version)
    assert store.versions() == [2, 3]
    with pytest.raises(VersionGone, match="pruned|not published"):
        store.load(1)
    other = RedisWeightStore(redis_server.url, store.namespace)
    try:
        assert other.pickup_time(3) is None
        other.note_pickup(3, 123.5)
        store.note_pickup(3, 999.0)  # first one wins
        assert store.pickup_time(3) == 123.5
    finally:
        other.close()


@pytest.mark.timeout(60)
def test_the_embedded_servers_client_user_has_every_command_it_needs(redis_server_factory):
    """The run's embedded Redis (restricted client user `headrace`, keys headrace:* only): the
    store publishes, loads, prunes and notes pickups as that user."""
    server = redis_server_factory(password="admin-pw", client_password="client-pw").start()
    store = RedisWeightStore(server.url, "run-1", keep=2, password="client-pw", chunk_bytes=64)
    try:
        assert "headrace@" in server.url
        for version in range(4):
            store.publish(make_params(version), version)
        assert store.latest_version() == 3 and store.versions() == [2, 3]
        assert_same(store.load(3), make_params(3))
        store.note_pickup(3, 1.0)
        assert store.pickup_time(3) == 1.0
        assert "client-pw" not in repr(store)
    finally:
        store.close()


def test_build_uses_the_buffers_server_and_refuses_none(tmp_path, redis_server):
    config = load(data={"weights": {"backend": "redis"}})
    with pytest.raises(ConfigError, match="weights.url"):
        build.make_weights(config, tmp_path)
    # The buffer's server fills an empty weights.url (the embedded one does the same).
    _, filled = build.start_embedded_redis(
        load(data={"weights": {"backend": "redis"},
                   "buffer": {"backend": "redis", "url": redis_server.url}}), tmp_path)
    assert filled.weights.url == redis_server.url
    store = build.make_weights(filled, tmp_path / "run-7")
    try:
        assert isinstance(store, RedisWeightStore) and store.namespace == "run-7"
        assert store.keep == filled.weights_keep and store.chunk_bytes == (8 << 20) - 4096
    finally:
        store.close()
    with pytest.raises(ConfigError, match="weights.chunk_mib"):
        load(data={"weights": {"backend": "redis", "chunk_mib": 0}})


def test_a_run_folder_with_any_name_is_a_namespace(redis_server):
    store = RedisWeightStore(redis_server.url, f"my run: {uuid.uuid4().hex[:6]} é", chunk_bytes=64)
    try:
        store.publish(make_params(0), 0)
        assert_same(store.load(0), make_params(0))
    finally:
        store.close()
    with pytest.raises(ValueError, match="namespace"):
        RedisWeightStore(redis_server.url, "")
