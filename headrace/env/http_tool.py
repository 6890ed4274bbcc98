"""http_tool: the tool_calculator task, with the calculator behind a real HTTP service.

`HttpCalculator` plays exactly like `ToolCalculator` (same questions, actions, rewards and
`solve`), but a `calc:` action is a `POST /calc` to `url`, made from `astep` with an asyncio-streams
HTTP/1.1 client (no extra dependency): a per-request timeout, and retries with exponential backoff
(with jitter) on connection errors, timeouts and 5xx answers. A 4xx answer (a malformed
expression) is the policy's mistake: an `error: ...` observation, not retried. When every attempt
fails the observation is `error: tool unavailable (...)`, or, with `on_failure="raise"`,
`ToolUnavailable` is raised for the actor to count as an environment error.

Info keys of a tool call, besides tool_calculator's: retries (this call), http_status (last, or
None), http_error (the last connection error, timeout or 5xx met during this call, even when a
retry then succeeded; None when there was none), tool_latency_s.

`CalculatorService` is the server: loopback, port 0 by default (the OS picks; read `url`), an
asyncio loop in a background thread, started and stopped by the test or example (also a context
manager, and `python -m headrace.env.http_tool --port 8731` runs one in the foreground). It can
inject latency, 503 failures and dropped connections, at random rates or scheduled for the next
requests (`inject`), so that tests can show retries and timeouts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import threading
import time
import urllib.parse
from typing import Any

from headrace.env.base import EnvError, StepResult
from headrace.env.tool_calculator import TOOL_DISABLED, CalcError, ToolCalculator, evaluate

MAX_BODY_BYTES = 65536


class ToolUnavailable(RuntimeError):
    """Every attempt to call the tool failed (connection errors, timeouts or 5xx answers)."""


# ------------------------------------------------------------------------------------- server

class CalculatorService:
    """A calculator HTTP service on loopback, served by an asyncio loop in a background thread.

    `POST /calc` with `{"expr": "37*48"}` answers 200 `{"result": "1776"}` or 400 `{"error": ...}`;
    `GET /health` answers 200. Faults, applied per request: first any scheduled by `inject`, else
    drawn at random: `drop_rate` closes the connection without an answer, `fail_rate` answers 503;
    every answer is delayed by `latency_s` (plus any injected delay).

    Raises:
      RuntimeError: from `start`, when the server cannot bind or does not come up within 5 s.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, latency_s: float = 0.0,
                 fail_rate: float = 0.0, drop_rate: float = 0.0, seed: int = 0):
        self.host, self.port = host, port
        self.latency_s, self.fail_rate, self.drop_rate = latency_s, fail_rate, drop_rate
        self.stats = {"requests": 0, "ok": 0, "bad_request": 0, "failed": 0, "dropped": 0}
        self._rng = random.Random(seed)
        self._scheduled: list[tuple[str, float]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def inject(self, fail: int = 0, drop: int = 0, delay_s: float = 0.0, delayed: int = 0) -> None:
        """Schedules faults for the next requests: `drop` dropped, then `fail` 503s, then `delayed`
        answers each `delay_s` late (in that order, one fault per request)."""
        with self._lock:
            self._scheduled += ([("drop", 0.0)] * drop + [("fail", 0.0)] * fail
                                + [("delay", delay_s)] * delayed)

    def start(self) -> CalculatorService:
        self._thread = threading.Thread(target=self._serve, name="calculator-service", daemon=True)
        self._thread.start()
        if not self._ready.wait(5.0) or self._error is not None:
            raise RuntimeError(f"CalculatorService did not start on {self.host}:{self.port}: "
                               f"{self._error or 'timeout'}")
        return self

    def stop(self) -> None:
        """Stops serving (pending answers are cancelled) and joins the thread (5 s at most)."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def __enter__(self) -> CalculatorService:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._stop = asyncio.Event()
            server = loop.run_until_complete(asyncio.start_server(self._handle, self.host,
                                                                  self.port))
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            loop.run_until_complete(self._stop.wait())
            server.close()
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(server.wait_closed())
        except BaseException as error:  # noqa: BLE001 - reported to start()
            self._error = error
            self._ready.set()
        finally:
            loop.close()

    def _next_fault(self) -> tuple[str, float]:
        with self._lock:
            self.stats["requests"] += 1
            if self._scheduled:
                return self._scheduled.pop(0)
            draw = self._rng.random()
        if draw < self.drop_rate:
            return "drop", 0.0
        if draw < self.drop_rate + self.fail_rate:
            return "fail", 0.0
        return "ok", 0.0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path, body = await asyncio.wait_for(_read_request(reader), 10.0)
            fault, delay = self._next_fault()
            if self.latency_s or delay:
                await asyncio.sleep(self.latency_s + delay)
            if fault == "drop":
                self._count("dropped")
                return
            if fault == "fail":
                self._count("failed")
                await _respond(writer, 503, {"error": "service unavailable (injected)"})
                return
            status, payload = self._route(method, path, body)
            self._count("ok" if status == 200 else "bad_request")
            await _respond(writer, status, payload)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            with contextlib.suppress(OSError):
                await _respond(writer, 400, {"error": "malformed request"})
        finally:
            writer.close()

    def _route(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        if method == "GET" and path == "/health":
            return 200, {"ok": True}
        if method != "POST" or path != "/calc":
            return 404, {"error": f"no route {method} {path}"}
        try:
            expr = json.loads(body)["expr"]
            if not isinstance(expr, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return 400, {"error": 'body must be JSON {"expr": "<expression>"}'}
        try:
            return 200, {"result": evaluate(expr)}
        except CalcError as error:
            return 400, {"error": str(error)}

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
    method, path, _ = (await reader.readline()).decode("latin-1").split(" ", 2)
    headers = await _read_headers(reader)
    length = int(headers.get("content-length", "0"))
    if not 0 <= length <= MAX_BODY_BYTES:
        raise ValueError(f"content-length {length}")
    return method, path, await reader.readexactly(length)


async def _read_headers(reader: asyncio.StreamReader) -> dict[str, str]:
    headers: dict[str, str] = {}
    while True:
        line = (await reader.readline()).decode("latin-1").strip()
        if not line:
            return headers
        if len(headers) > 100:
            raise ValueError("too many headers")
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()


async def _respond(writer: asyncio.StreamWriter, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 503: "Service Unavailable"}
    writer.write(f"HTTP/1.1 {status} {reason.get(status, 'Error')}\r\nContent-Type: "
                 f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                 .encode() + body)
    await writer.drain()


# ------------------------------------------------------------------------------------- client

@dataclasses.dataclass
class ToolResponse:
    """The outcome of one tool call, after retries."""

    result: str | None  # the calculator's answer, when ok
    error: str | None  # why not: the service's 4xx message, or the last transport failure
    status: int | None  # the last HTTP status received, None when none arrived
    retries: int  # attempts beyond the first
    latency_s: float  # wall time of the whole call, retries and backoff included
    failure: str | None = None  # the last transport failure or 5xx met, even if a retry succeeded

    @property
    def ok(self) -> bool:
        return self.result is not None

    @property
    def client_error(self) -> bool:
        """A 4xx: the request itself was wrong (not retried)."""
        return self.status is not None and 400 <= self.status < 500


class ToolClient:
    """Calls the calculator service: one HTTP/1.1 request per attempt, retries with backoff.

    Retries on connection errors, timeouts (`timeout_s` per attempt) and 5xx answers, sleeping
    `backoff_s * 2**k` (capped at `backoff_max_s`, scaled by a random factor in [0.5, 1]) before
    attempt k+1. Never raises for transport failures: the `ToolResponse` says what happened.
    """

    def __init__(self, url: str, timeout_s: float = 2.0, retries: int = 3,
                 backoff_s: float = 0.05, backoff_max_s: float = 1.0, seed: int | None = None):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            raise EnvError(f"http_tool: url={url!r} must look like http://HOST:PORT (start a "
                           "CalculatorService, or `python -m headrace.env.http_tool`, and pass "
                           "its url in env.kwargs.url)")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise EnvError(f"http_tool: timeout_s={timeout_s} must be > 0, retries={retries} and "
                           f"backoff_s={backoff_s} >= 0")
        self.host, self.port = parts.hostname, parts.port
        self.timeout_s, self.retries = timeout_s, retries
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self._rng = random.Random(seed)

    async def call(self, expr: str) -> ToolResponse:
        started = time.monotonic()
        status: int | None = None
        failure: str | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                delay = min(self.backoff_s * 2 ** (attempt - 1), self.backoff_max_s)
                await asyncio.sleep(delay * self._rng.uniform(0.5, 1.0))
            try:
                status, body = await asyncio.wait_for(self._exchange(expr), self.timeout_s)
            except TimeoutError:
                status, failure = None, f"timeout after {self.timeout_s:g} s"
                continue
            except (OSError, asyncio.IncompleteReadError, ValueError) as error:
                status, failure = None, f"{type(error).__name__}: {error}"
                continue
            if status >= 500:
                failure = f"HTTP {status}"
                continue
            try:
                payload = json.loads(body)
            except ValueError:
                payload = {}
            if status == 200 and isinstance(payload.get("result"), str):
                return ToolResponse(payload["result"], None, status, attempt,
                                    time.monotonic() - started, failure)
            message = payload.get("error") if isinstance(payload, dict) else None
            return ToolResponse(None, str(message or f"HTTP {status}")[:200], status, attempt,
                                time.monotonic() - started, failure)
        return ToolResponse(None, failure, status, self.retries, time.monotonic() - started,
                            failure)

    async def _exchange(self, expr: str) -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            body = json.dumps({"expr": expr}).encode()
            writer.write(f"POST /calc HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: "
                         f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close"
                         "\r\n\r\n".encode() + body)
            await writer.drain()
            status_line = await reader.readline()
            if not status_line:
                raise ConnectionResetError("connection closed without an answer")
            status = int(status_line.split()[1])
            headers = await _read_headers(reader)
            length = int(headers.get("content-length", "-1"))
            if length > MAX_BODY_BYTES:
                raise ValueError(f"answer of {length} bytes")
            data = await (reader.readexactly(length) if length >= 0
                          else reader.read(MAX_BODY_BYTES))
            return status, data
        finally:
            writer.close()


# ---------------------------------------------------------------------------------- environment

_LOCAL: CalculatorService | None = None
_LOCAL_LOCK = threading.Lock()


def local_service() -> CalculatorService:
    """This process's own loopback service (`url: auto`), started on first use; it serves on its
    daemon thread until the process ends."""
    global _LOCAL
    with _LOCAL_LOCK:
        if _LOCAL is None:
            _LOCAL = CalculatorService().start()
        return _LOCAL


class HttpCalculator(ToolCalculator):
    """tool_calculator whose tool is the HTTP service at `url` (see the module docstring).

    Args:
      url: the service, e.g. `CalculatorService().start().url`; `auto`: a loopback service this
        process starts on first use and shares between its environments (`local_service`).
      timeout_s, retries, backoff_s, backoff_max_s: the client's (see `ToolClient`).
      on_failure: "observe" (an error observation) or "raise" (`ToolUnavailable`) when every
        attempt failed.
      digits, terms, ops, max_turns, tool_enabled: as `ToolCalculator`.

    `step` runs `astep` on a private event loop (`asyncio.run`), so it must not be called from a
    running loop; the actor calls `astep`.
    """

    blocking = True  # `step` waits on the network
    env_name = "http_tool"

    def __init__(self, url: str = "", timeout_s: float = 2.0, retries: int = 3,
                 backoff_s: float = 0.05, backoff_max_s: float = 1.0, on_failure: str = "observe",
                 **kwargs: Any):
        super().__init__(**kwargs)
        if on_failure not in ("observe", "raise"):
            raise EnvError(f"http_tool: on_failure={on_failure!r} must be 'observe' or 'raise'")
        if url == "auto":
            url = local_service().url
        self.client = ToolClient(url, timeout_s, retries, backoff_s, backoff_max_s)
        self.on_failure = on_failure

    def step(self, action: str) -> StepResult:
        return asyncio.run(self.astep(action))

    async def astep(self, action: str) -> StepResult:
        parsed = self._begin(action)
        if not isinstance(parsed, str):
            return parsed
        extra: dict[str, Any] = {"retries": 0, "http_status": None, "http_error": None,
                                 "tool_latency_s": 0.0}
        if not self.tool_enabled:
            return self._tool_result(TOOL_DISABLED, tool_error=False, extra=extra)
        response = await self.client.call(parsed)
        extra.update(retries=response.retries, http_status=response.status,
                     tool_latency_s=round(response.latency_s, 4),
                     http_error=response.failure)
        if response.ok:
            return self._tool_result(f"= {response.result}", tool_error=False, extra=extra)
        if response.client_error:
            return self._tool_result(f"error: {response.error}", tool_error=True, extra=extra)
        if self.on_failure == "raise":
            raise ToolUnavailable(f"http_tool: {self.client.host}:{self.client.port} failed "
                                  f"{response.retries + 1} times, last: {response.error}")
        return self._tool_result(f"error: tool unavailable ({response.error})", tool_error=True,
                                 extra=extra)


def main(argv: list[str] | None = None) -> None:
    """Runs a CalculatorService in the foreground until Ctrl-C (for examples)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--latency-s", type=float, default=0.0)
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument("--drop-rate", type=float, default=0.0)
    args = parser.parse_args(argv)
    service = CalculatorService(args.host, args.port, args.latency_s, args.fail_rate,
                                args.drop_rate).start()
    print(f"calculator service on {service.url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        service.stop()


if __name__ == "__main__":
    main()
