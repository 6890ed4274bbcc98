"""http_tool: a real loopback service, retries with backoff on drops, 5xx and timeouts, counted."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from headrace.config import EnvConfig
from headrace.env.base import EnvError
from headrace.env.http_tool import CalculatorService, HttpCalculator, ToolClient, ToolUnavailable
from headrace.env.registry import env_factory

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def service():
    server = CalculatorService().start()
    try:
        yield server
    finally:
        server.stop()


def _env(service, **kwargs) -> HttpCalculator:
    # 5 s per request: the exact retry counts asserted below must not pick up an extra retry
    # because one loopback round trip was slow on a loaded machine.
    kwargs = {"timeout_s": 5.0, "retries": 3, "backoff_s": 0.01, **kwargs}
    return HttpCalculator(url=service.url, **kwargs)


def test_solve_through_the_service(service):
    env = _env(service)
    for seed in range(5):
        env.reset(seed)
        for action in env.solve(seed):
            obs, reward, terminated, truncated, info = asyncio.run(env.astep(action))
        assert (reward, terminated, info["success"]) == (1.0, True, True)
    assert service.stats["ok"] == 5 and service.stats["requests"] == 5


def test_sync_step_matches_local_calculator(service):
    env = _env(service)
    env.reset(3)
    obs, reward, terminated, truncated, info = env.step("calc: 37*48")
    assert obs == "= 1776" and info["retries"] == 0 and info["http_status"] == 200
    assert info["http_error"] is None and info["tool_latency_s"] > 0


def test_retries_on_503_and_dropped_connections(service):
    env = _env(service)
    env.reset(0)
    service.inject(drop=1, fail=2)
    obs, _, _, _, info = env.step("calc: 2+2")
    assert obs == "= 4" and info["retries"] == 3 and info["http_error"] == "HTTP 503"
    assert service.stats["dropped"] == 1 and service.stats["failed"] == 2
    service.inject(drop=1)
    obs, _, _, _, info = env.step("calc: 2+3")
    assert obs == "= 5" and info["retries"] == 1
    assert info["http_error"].startswith("RemoteProtocolError: Server disconnected")


def test_per_request_timeout_then_retry(service):
    env = _env(service, timeout_s=1.0)
    env.reset(0)
    service.inject(delay_s=5.0, delayed=1)
    started = time.monotonic()
    obs, _, _, _, info = env.step("calc: 3*3")
    assert obs == "= 9" and info["retries"] == 1 and info["http_error"] == "timeout after 1 s"
    # At least the 1 s timeout; well before the delayed answer (5 s), which waiting it out
    # instead of timing out and retrying would take.
    assert 1.0 <= time.monotonic() - started < 4.5


def test_exhausted_retries_observe_or_raise(service):
    env = _env(service, retries=2)
    env.reset(0)
    service.inject(fail=3)
    obs, reward, terminated, truncated, info = env.step("calc: 1+1")
    assert obs == "error: tool unavailable (HTTP 503)" and info["tool_error"]
    assert info["retries"] == 2 and not terminated and reward == 0.0
    raising = _env(service, retries=1, on_failure="raise")
    raising.reset(0)
    service.inject(fail=2)
    with pytest.raises(ToolUnavailable, match="failed 2 times"):
        raising.step("calc: 1+1")


def test_malformed_expression_is_not_retried(service):
    env = _env(service)
    env.reset(0)
    obs, _, terminated, _, info = env.step("calc: 2+")
    assert obs.startswith("error: cannot parse") and info["tool_error"] and not terminated
    assert info["retries"] == 0 and info["http_status"] == 400 and info["http_error"] is None


def test_connection_refused_is_retried_then_reported():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = HttpCalculator(url=f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01)
    env.reset(0)
    obs, _, _, _, info = env.step("calc: 1+1")
    assert obs.startswith("error: tool unavailable (ConnectionRefusedError")
    assert info["retries"] == 2 and info["http_status"] is None


def test_random_failures_are_absorbed_by_retries():
    with CalculatorService(fail_rate=0.3, drop_rate=0.1, seed=1) as service:
        env = _env(service, retries=8)
        retries = 0
        for seed in range(30):
            env.reset(seed)
            obs, _, _, _, info = env.step(env.solve(seed)[0])
            assert obs.startswith("= "), info
            retries += info["retries"]
        assert retries > 0 and service.stats["ok"] == 30


def test_many_episodes_wait_concurrently():
    with CalculatorService(latency_s=0.3) as service:
        envs = [_env(service, timeout_s=20.0) for _ in range(100)]
        for seed, env in enumerate(envs):
            env.reset(seed)

        async def all_calls():
            return await asyncio.gather(*(env.astep(env.solve(seed)[0])
                                          for seed, env in enumerate(envs)))

        started = time.monotonic()
        results = asyncio.run(all_calls())
        assert all(obs.startswith("= ") for obs, *_ in results)
        # 100 x 0.3 s sequentially would be 30 s; concurrently ~0.3 s plus the loaded machine's
        # overhead: 15 s is half the sequential time, so serialised calls still fail it.
        assert time.monotonic() - started < 15.0


def test_service_routes_and_stop():
    service = CalculatorService().start()
    url = service.url
    client = ToolClient(url, retries=0)
    assert asyncio.run(client.call("1+1")).result == "2"
    with socket.create_connection(("127.0.0.1", service.port), timeout=1) as conn:
        conn.sendall(b"GET /nope HTTP/1.1\r\n\r\n")
        assert conn.recv(100).startswith(b"HTTP/1.1 404")
    service.stop()
    response = asyncio.run(ToolClient(url, retries=0).call("1+1"))
    assert not response.ok and "ConnectionRefusedError" in response.error


def test_bad_arguments_and_registry(service):
    with pytest.raises(EnvError, match="http://HOST:PORT"):
        HttpCalculator()
    with pytest.raises(EnvError, match="on_failure"):
        HttpCalculator(url=service.url, on_failure="ignore")
    make = env_factory(EnvConfig(name="http_tool", kwargs={"url": service.url, "digits": 1}))
    env = make()
    assert isinstance(env, HttpCalculator) and env.has_astep and env.digits == 1


def test_an_oversized_answer_is_refused_not_buffered():
    """A broken service streaming a huge body: the client stops reading at MAX_BODY_BYTES."""
    import threading

    from headrace.env.http_tool import MAX_BODY_BYTES

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 10000000\r\n\r\n")
            try:
                for _ in range(100):
                    conn.sendall(b"x" * 100_000)
            except OSError:
                pass  # the client hung up, as it should

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        client = ToolClient(f"http://127.0.0.1:{listener.getsockname()[1]}", retries=0)

        async def call():
            try:
                return await client.call("1+1")
            finally:
                await client.aclose()

        response = asyncio.run(call())
    finally:
        thread.join(10)
        listener.close()
    assert not response.ok and response.error == f"answer over {MAX_BODY_BYTES} bytes"
    assert response.status == 200

