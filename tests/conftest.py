"""Shared fixtures: a real local redis-server, unique run ids, small groups.

Also sets the process-wide JAX environment for the suite. Redis fixtures skip (with the reason)
when no redis-server binary exists; every server they start
is stopped in a `finally`, so no test leaves a process behind.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import uuid

from headrace import xla_flags

# Before JAX is imported anywhere: 8 simulated CPU devices, XLA:CPU's memory scheduler (what
# `headrace` itself asks for), and one compilation cache shared by every test process
# (subprocesses inherit these variables).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["XLA_FLAGS"] = xla_flags.with_cpu_memory_scheduler(os.environ["XLA_FLAGS"])
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(__file__).resolve().parent.parent / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import numpy as np
import pytest

from headrace.buffer.server import RedisServer, RedisServerError, find_redis_server
from headrace.types import Group, Trajectory, Turn


def _require_redis() -> None:
    try:
        find_redis_server()
    except RedisServerError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One redis-server (appendonly, fsync everysec, no password) shared by the session.

    Tests share it safely by using a unique `run_id` (keys carry it).
    """
    _require_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server_factory(tmp_path):
    """Makes private servers (`factory(subdir="redis", **RedisServer kwargs)`), not yet started;
    all are stopped when the test ends."""
    _require_redis()
    servers: list[RedisServer] = []

    def make(subdir: str = "redis", **kwargs) -> RedisServer:
        server = RedisServer(tmp_path / subdir, **kwargs)
        servers.append(server)
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def interrupt():
    """`interrupt(process, timeout_s, what)`: Ctrl-C a child, wait for it, return its (stdout,
    stderr); the test fails with the child's stderr if it does not stop in time.

    Children start with Ctrl-C's default disposition. A suite started as a background job
    (`cmd &` in a script) inherits SIGINT ignored, and so would every child it spawns: Python
    then keeps it ignored and a SIGINT test's child never sees its signal."""

    def send(process: subprocess.Popen, timeout_s: float, what: str) -> tuple[str, str]:
        process.send_signal(signal.SIGINT)
        try:
            return process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            pytest.fail(f"{what} did not stop within {timeout_s:.0f} s of SIGINT; its stderr:\n"
                        + process.communicate()[1][-5000:])

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield send
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def run_id() -> str:
    """A run id no other test uses (so tests can share one Redis)."""
    return f"test-{uuid.uuid4().hex[:12]}"


def make_group(index: int, *, trajectories: int = 2, tokens: int = 6) -> Group:
    """A small valid group whose ids and contents are derived from `index`."""
    group_id = f"g{index}"
    items = []
    for j in range(trajectories):
        n = tokens + j
        items.append(Trajectory(
            trajectory_id=f"{group_id}-t{j}", group_id=group_id, task_id=f"task{index}",
            env="guess_number", actor_id="actor0",
            tokens=np.arange(n, dtype=np.int32) + index,
            loss_mask=np.arange(n) % 2 == 1,
            behaviour_logprobs=-np.linspace(0.1, 1.0, n, dtype=np.float32),
            policy_version=np.where(np.arange(n) % 2 == 1, index, -1).astype(np.int32),
            turns=[Turn(0, n // 2, "user"), Turn(n // 2, n, "assistant", float(index))],
            reward=float(index), timings={"started": 1000.0 + index}))
    return Group(group_id, f"task{index}", items, put_version=index)


@pytest.fixture
def group_factory():
    """`make_group(index, trajectories=2, tokens=6)` as a fixture."""
    return make_group
