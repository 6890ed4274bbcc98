"""The calculator HTTP service behind `http_tool` (`headrace.env.http_tool`): loopback, asyncio
streams, with injectable latency, 503s and dropped connections for tests and examples."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
from typing import Any

from headrace.env.tool_calculator import CalcError, evaluate

MAX_BODY_BYTES = 65536


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
