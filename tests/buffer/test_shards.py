"""Buffer shards (`headrace.buffer.sharded`): the stable actor→shard map, each learner host's
share, admission counting every shard (one server and several), quarantine and the accounting
identity per shard and in total, and exactly-once delivery across shards under concurrent
writers. The contract itself runs over two shards in test_contract.py."""

from __future__ import annotations

import collections
import subprocess
import sys
import threading

import pytest

from headrace.buffer.admission_redis import RedisAdmission
from headrace.buffer.redis_stream import FIELD, RedisBuffer
from headrace.buffer.sharded import ShardedBuffer, read_shards, shard_of
from headrace.config import ConfigError, load
from headrace.runtime import build


def test_the_shard_of_an_actor_is_the_same_in_every_process():
    names = [f"actor-{i}" for i in range(64)]
    here = [shard_of(n, 4) for n in names]
    code = ("import sys; from headrace.buffer.sharded import shard_of; "
            f"print([shard_of(n, 4) for n in {names!r}])")
    # a fresh interpreter has another str hash seed: the map must not depend on it
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, env={"PYTHONHASHSEED": "123", "PYTHONPATH": "."})
    assert there.returncode == 0, there.stderr
    assert eval(there.stdout) == here
    assert set(here) == {0, 1, 2, 3}  # 64 names reach every one of 4 shards


@pytest.mark.parametrize("hosts, shards", [(1, 4), (2, 4), (3, 8), (4, 4), (2, 3)])
def test_learner_hosts_read_disjoint_shares_that_cover_every_shard(hosts, shards):
    shares = [read_shards(h, hosts, shards) for h in range(hosts)]
    flat = [s for share in shares for s in share]
    assert sorted(flat) == list(range(shards))  # every shard read, by exactly one host
    assert shares[0][:2] == [0, hosts][: len(shares[0][:2])]  # host i reads i, i + hosts, ...


def test_more_learner_hosts_than_shards_is_refused(redis_server, run_id):
    config = load(data={"buffer": {"url": redis_server.url, "shards": 2}})
    with pytest.raises(ConfigError, match="fewer shards than the 3 learner hosts"):
        build.make_buffer(config, run_id=run_id, consumer="learner-2", host=2, hosts=3)


def _shards(url_of, run_id, consumer, n, **kwargs):
    return [RedisBuffer(url_of(i), run_id=run_id, consumer=consumer, shard=i, **kwargs)
            for i in range(n)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("servers", [1, 2])
def test_admission_counts_the_groups_of_every_shard(redis_server_factory, run_id,
                                                     group_factory, servers):
    """One server (`buffer.shards`: every stream read inside the script) or two
    (`buffer.urls`: the other server's counts passed in): the forecast's depth and queue are
    the totals over both shards."""
    started = [redis_server_factory(f"r{i}").start() for i in range(servers)]
    urls = [s.url for s in started]
    config = load(data={"buffer": {"urls": urls} if servers == 2 else
                        {"url": urls[0], "shards": 2},
                        "learner": {"groups_per_batch": 4, "publish_every": 1},
                        "staleness": {"max_policy_lag": 100}})
    writers = [build.make_buffer(config, run_id=run_id, consumer=name)
               for name in ("actor-a", "actor-c")]  # shards 1 and 0
    assert sorted(w.write for w in writers) == [0, 1]
    reader = build.make_buffer(config, run_id=run_id, consumer="learner-0", host=0, hosts=1)
    admission = build.make_admission(config, reader, url=urls[0], run_id=run_id)
    try:
        assert isinstance(admission, RedisAdmission)
        writers[0].put([group_factory(i) for i in range(3)], timeout_s=5)
        writers[1].put([group_factory(10 + i) for i in range(5)], timeout_s=5)
        forecast = admission.forecast(0)
        assert (forecast.depth, forecast.learner_queued) == (8, 0)
        got = reader.get(8, timeout_s=5)
        got += reader.get(8, timeout_s=5)  # the other shard's (one shard per call)
        assert len(got) == 8
        forecast = admission.forecast(0)
        assert (forecast.depth, forecast.learner_queued) == (0, 8)
        reader.ack([e.id for e in got])
        assert admission.forecast(0).learner_queued == 0
    finally:
        admission.drop()
        admission.close()
        for buffer in (*writers, reader):
            buffer.drop()
            buffer.close()


@pytest.mark.timeout(60)
def test_quarantine_and_the_identity_hold_per_shard_and_in_total(redis_server, run_id,
                                                                 group_factory):
    shards = _shards(lambda i: redis_server.url, run_id, "learner-0", 3)
    buffer = ShardedBuffer(shards, read=[0, 1, 2])
    writers = {i: ShardedBuffer(_shards(lambda _: redis_server.url, run_id, f"w{i}", 3), write=i)
               for i in range(3)}
    client = redis_server.client()
    try:
        for i, writer in writers.items():
            writer.put([group_factory(10 * i + k) for k in range(i + 1)], timeout_s=5)
        client.xadd(shards[1].stream_key, {FIELD: b"\x93not a group"})  # poison in shard 1
        client.incrby(f"headrace:{{{run_id}:1}}:added", 1)
        got = []
        for _ in range(6):
            got += buffer.get(10, timeout_s=0.5)
        assert sorted(e.group.group_id for e in got) == ["g0", "g10", "g11", "g20", "g21", "g22"]
        buffer.ack([e.id for e in got[:2]])
        stats = buffer.stats()
        assert stats["buffer/quarantined"] == 1
        per_shard = []
        for shard in shards:
            ids = shard.all_ids()
            added, in_buffer = shard.added(), len(ids["undelivered"] | ids["pending"])
            per_shard.append((added, in_buffer, len(ids["quarantined"])))
        assert [a for a, _, _ in per_shard] == [1, 3, 3]
        assert [q for _, _, q in per_shard] == [0, 1, 0]
        # written = acknowledged (trained) + quarantined + still in the buffer, per shard...
        acked = collections.Counter(int(e.id.split("/")[0]) for e in got[:2])
        for index, (added, in_buffer, quarantined) in enumerate(per_shard):
            assert added == acked[index] + quarantined + in_buffer, index
        # ... and in total, through the sharded view
        ids = buffer.all_ids()
        assert buffer.added() == 7 == 2 + len(ids["quarantined"]) + len(
            ids["undelivered"] | ids["pending"])
        assert stats["buffer/written_shard1"] == 3
    finally:
        client.close()
        buffer.drop()
        for b in (buffer, *writers.values()):
            b.close()


@pytest.mark.timeout(60)
def test_concurrent_writers_on_three_shards_are_each_delivered_once(redis_server, run_id,
                                                                   group_factory):
    n, per_writer, names = 3, 40, [f"actor-{i}" for i in range(6)]
    writers = [ShardedBuffer(_shards(lambda i: redis_server.url, run_id, name, n, capacity=512),
                             write=shard_of(name, n)) for name in names]
    readers = [ShardedBuffer(_shards(lambda i: redis_server.url, run_id, f"learner-{h}", n,
                                     capacity=512), read=read_shards(h, 2, n)) for h in range(2)]
    errors: list[BaseException] = []

    def write(k: int) -> None:
        try:
            for j in range(per_writer):
                writers[k].put([group_factory(1000 * k + j)], timeout_s=10)
        except BaseException as error:  # noqa: BLE001  (reported below)
            errors.append(error)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(len(names))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not errors and not any(t.is_alive() for t in threads)
        seen: list[str] = []
        for reader in readers:
            while batch := reader.get(64, timeout_s=0.2):
                seen += [e.group.group_id for e in batch]
                reader.ack([e.id for e in batch])
        expected = {f"g{1000 * k + j}" for k in range(len(names)) for j in range(per_writer)}
        assert len(seen) == len(expected) and set(seen) == expected  # each exactly once
        written = readers[0].stats()
        assert all(written[f"buffer/written_shard{s}"] > 0 for s in range(n))
    finally:
        readers[0].drop()
        for b in (*writers, *readers):
            b.close()


@pytest.mark.parametrize("buffer, run, message", [
    ({"url": "redis://a:1/0", "urls": ["redis://b:1/0"]}, {}, "not both"),
    ({"urls": ["redis://a:1/0", "redis://b:1/0"], "shards": 3}, {}, "names 2 servers"),
    ({"url": "redis://:hunter2@a:1/0"}, {}, "carries a password"),
    ({"urls": ["redis://user:hunter2@a:1/0"]}, {}, "carries a password"),
    ({"shards": 0}, {}, "must be >= 1"),
    ({"shards": 2, "backend": "redis"}, {"launcher": "threads"}, "run.launcher=processes"),
    ({"port": 70000}, {}, "buffer.port"),
])
def test_bad_shard_settings_are_one_clear_error(buffer, run, message):
    with pytest.raises(ConfigError, match=message) as error:
        load(data={"buffer": buffer, "run": run})
    assert "hunter2" not in str(error.value)  # a URL's password is shown as ***


def test_shard_urls_follow_urls_else_url_else_the_embedded_server():
    b = load(data={"buffer": {"urls": ["redis://a:1/0", "redis://b:2/0"]}}).buffer
    assert (b.shard_count, b.shard_url(0), b.shard_url(1)) == (2, "redis://a:1/0",
                                                               "redis://b:2/0")
    b = load(data={"buffer": {"url": "redis://a:1/0", "shards": 4}}).buffer
    assert (b.shard_count, b.shard_url(3, "redis://embedded")) == (4, "redis://a:1/0")
    b = load(data={"buffer": {"shards": 2}}).buffer
    assert b.shard_url(1, "redis://embedded:5/0") == "redis://embedded:5/0"
    assert b.host == "127.0.0.1"  # loopback unless told otherwise
