"""The embedded Redis's access control, on a real redis-server: the client user does what headrace
needs and nothing dangerous, passwords never reach the run folder in plain text, and starting the
server from a multithreaded (JAX) process raises no fork warning."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from headrace.buffer.admission import AdmissionLimits
from headrace.buffer.admission_redis import RedisAdmission
from headrace.buffer.base import BufferError
from headrace.buffer.redis_stream import RedisBuffer
from headrace.buffer.server import (
    CLIENT_USER,
    SECRETS_FILE,
    RedisCredentials,
    RedisServer,
    RedisServerError,
)
from headrace.config import BufferConfig
from tests.conftest import _require_redis, make_group

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def run_server(tmp_path):
    """A run's embedded server (`for_run`) with fresh credentials in tmp_path/secrets.json."""
    _require_redis()
    credentials = RedisCredentials.for_run(tmp_path)
    server = RedisServer.for_run(BufferConfig(backend="redis"), tmp_path / "redis", credentials)
    server.start()
    try:
        yield server, credentials
    finally:
        server.stop()


def _as_client(server: RedisServer, password: str | None) -> redis.Redis:
    return redis.Redis.from_url(server.url, password=password, retry=Retry(NoBackoff(), 0),
                                socket_timeout=5)


def _a_group_through(server: RedisServer, credentials: RedisCredentials, run_id: str) -> None:
    """A group put and read back through the buffer as the client user, as the learner and
    actors use it."""
    buffer = RedisBuffer(server.url, run_id=run_id, consumer="c", password=credentials.client)
    try:
        buffer.put([make_group(1)], timeout_s=5)
        [entry] = buffer.get(1, timeout_s=5)
        assert entry.group.group_id == "g1"
        buffer.ack([entry.id])
    finally:
        buffer.close()


def test_the_client_user_has_what_headrace_needs(run_server, run_id):
    server, credentials = run_server
    assert server.url.startswith(f"redis://{CLIENT_USER}@127.0.0.1:")
    client = _as_client(server, credentials.client)
    try:
        assert client.acl_whoami() == CLIENT_USER
        sha = client.script_load("return redis.call('XLEN', KEYS[1])")
        client.xadd("headrace:x:stream", {"a": "1"})
        assert client.evalsha(sha, 1, "headrace:x:stream") == 1
        client.xgroup_create("headrace:x:stream", "g", id="0")
        assert client.xreadgroup("g", "c", {"headrace:x:stream": ">"}, count=1)
        assert list(client.scan_iter(match="headrace:x:*")) == [b"headrace:x:stream"]
    finally:
        client.close()
    _a_group_through(server, credentials, run_id)  # the real components, as the learner's
    admission = RedisAdmission(server.url, AdmissionLimits(4, 1, 2), run_id=run_id,
                               password=credentials.client)
    try:  # its Lua scripts (SCRIPT LOAD + EVALSHA) and a scan
        admission.learner_update(3, 0, 0, 0.1)
        assert admission.learner_state().version == 3
        assert admission.heartbeat("actor-0") == 0 and admission.in_flight() == 0
        admission.drop()
    finally:
        admission.close()


@pytest.mark.parametrize("command", [
    ("CONFIG", "GET", "requirepass"), ("CONFIG", "SET", "dir", "/tmp"), ("DEBUG", "SLEEP", "0"),
    ("MODULE", "LIST"), ("SHUTDOWN", "NOSAVE"), ("FLUSHALL",), ("FLUSHDB",), ("KEYS", "*"),
    ("ACL", "LIST"), ("MONITOR",), ("SCRIPT", "FLUSH"), ("BGREWRITEAOF",), ("SAVE",),
    ("REPLICAOF", "127.0.0.1", "1"), ("CLIENT", "KILL", "TYPE", "normal"), ("SORT", "headrace:l"),
    ("SET", "not-headrace", "1"), ("GET", "not-headrace"),
])
def test_the_client_user_cannot_run_dangerous_commands(run_server, command):
    server, credentials = run_server
    client = _as_client(server, credentials.client)
    try:
        # DEBUG and MODULE are also off for every connection (enable-*-command defaults)
        with pytest.raises(redis.ResponseError, match="no permissions|not allowed"):
            client.execute_command(*command)
    finally:
        client.close()
    assert server.running  # SHUTDOWN was refused, the server still answers
    admin = server.client()
    try:  # the ACL itself refuses it, whatever the server's other settings
        verdict = admin.execute_command("ACL", "DRYRUN", CLIENT_USER, *command)
        assert b"no permissions" in verdict, verdict
        assert admin.execute_command("ACL", "DRYRUN", "default", *command) == b"OK"
    finally:
        admin.close()


def test_without_the_password_nothing_is_served(run_server, run_id):
    server, credentials = run_server
    for password in (None, "wrong", credentials.admin):  # the admin's is not the client's
        client = _as_client(server, password)
        try:
            with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
                client.set("headrace:x", 1)
        finally:
            client.close()
    anonymous = redis.Redis(host=server.host, port=server.port, retry=Retry(NoBackoff(), 0))
    try:
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
    finally:
        anonymous.close()
    with pytest.raises(BufferError, match="authentication"):
        RedisBuffer(server.url, run_id=run_id, consumer="c", password="wrong")


def test_only_the_admin_shuts_it_down(run_server):
    server, _ = run_server
    admin = server.client()
    try:
        assert admin.acl_whoami() == "default"
    finally:
        admin.close()
    server.stop()  # SHUTDOWN as the default user: the server flushes and exits, not SIGTERMed
    assert not server.running
    assert "Redis is now ready to exit" in server.log_path.read_text()


def test_no_plain_password_in_the_folder_and_secrets_are_private(tmp_path, run_server):
    server, credentials = run_server
    path = tmp_path / SECRETS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"admin": credentials.admin,
                                            "client": credentials.client}
    assert len(credentials.admin) >= 32 and credentials.admin != credentials.client
    conf = server.dir / "redis.conf"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    for file in server.dir.rglob("*"):
        if file.is_file():
            text = file.read_bytes()
            assert credentials.admin.encode() not in text and \
                credentials.client.encode() not in text, file
    assert "***" in repr(credentials) and credentials.admin not in repr(credentials)


def test_secrets_come_back_on_resume_and_a_user_password_is_never_stored(tmp_path):
    for name in "abcd":
        (tmp_path / name).mkdir()
    first = RedisCredentials.for_run(tmp_path / "a")
    again = RedisCredentials.for_run(tmp_path / "a", resume=True)
    assert (again.admin, again.client) == (first.admin, first.client)
    assert RedisCredentials.for_run(tmp_path / "b", resume=False) != first  # random per run

    given = RedisCredentials.for_run(tmp_path / "c", "user's own")
    assert given.client == "user's own"
    assert b"user's own" not in (tmp_path / "c" / SECRETS_FILE).read_bytes()
    with pytest.raises(RedisServerError, match="HEADRACE_REDIS_PASSWORD"):
        RedisCredentials.for_run(tmp_path / "c", resume=True)
    assert RedisCredentials.for_run(tmp_path / "c", "user's own", resume=True).client == \
        "user's own"
    with pytest.raises(RedisServerError, match="missing"):
        RedisCredentials.for_run(tmp_path / "d", resume=True)
    (tmp_path / "d" / SECRETS_FILE).write_text("{not json")
    with pytest.raises(RedisServerError, match="unreadable"):
        RedisCredentials.for_run(tmp_path / "d", resume=True)


@pytest.mark.parametrize("deep", [False, True])
def test_a_unix_socket_server_opens_no_port_and_only_its_user_may_connect(tmp_path, run_id, deep):
    """`buffer.transport: unix`: the socket is the folder's, or (a path longer than a socket
    address may be) a private temporary folder's that `stop` removes."""
    _require_redis()
    folder = tmp_path / ("d" * 120 if deep else "") / "redis"
    credentials = RedisCredentials.for_run(tmp_path)
    server = RedisServer.for_run(BufferConfig(backend="redis", transport="unix"), folder,
                                 credentials).start()
    try:
        assert server.url == f"unix://{CLIENT_USER}@{server.socket}?db=0"
        assert (server.socket.parent == folder.resolve()) != deep
        mode = server.socket.stat().st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o700
        assert stat.S_IMODE(server.socket.parent.stat().st_mode) & 0o077 == 0 or not deep
        client = _as_client(server, credentials.client)
        try:
            assert client.acl_whoami() == CLIENT_USER
            assert client.info("server")["tcp_port"] == 0  # no TCP listener at all
        finally:
            client.close()
        _a_group_through(server, credentials, run_id)
        url = server.url
        server.kill()  # a crash: restarted where its clients look for it
        assert server.start().url == url and _as_client(server, credentials.client).ping()
    finally:
        socket = server.socket
        server.stop()
    assert not socket.exists() and socket.parent.exists() != deep
    server.start()  # again: the folder's socket, or a new private folder
    try:
        assert server.socket.parent.exists() and _as_client(server, credentials.client).ping()
    finally:
        server.stop()


def test_another_interface_needs_a_password(tmp_path):
    with pytest.raises(ValueError, match="loopback"):
        RedisServer(tmp_path, host="0.0.0.0")
    with pytest.raises(ValueError, match="needs password"):
        RedisServer(tmp_path, client_password="x")
    RedisServer(tmp_path, host="::1")  # loopback: fine without one


def test_starting_from_a_multithreaded_jax_process_gives_no_fork_warning(tmp_path):
    """JAX warns at every os.fork() of a process it runs threads in; a preexec_fn makes
    subprocess call those fork handlers. The server must start without them."""
    _require_redis()
    program = textwrap.dedent(f"""
        import threading, warnings
        warnings.simplefilter("always")
        import jax.numpy as jnp
        float(jnp.ones(4).sum())  # JAX's threads are running now
        from headrace.buffer.server import RedisCredentials, RedisServer
        from headrace.config import BufferConfig
        run = {str(tmp_path)!r}
        creds = RedisCredentials.for_run(run)
        server = RedisServer.for_run(BufferConfig(backend="redis"), run + "/redis", creds)
        started = []
        worker = threading.Thread(target=lambda: started.append(server.start()))
        worker.start(); worker.join()  # from a thread too (the spawner thread's path)
        assert threading.active_count() > 1
        server.stop()
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-W", "always", "-c", program],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    assert "fork" not in result.stderr, result.stderr
