"""http_tool: the tool_calculator task, with the calculator behind a real HTTP service.

`HttpCalculator` plays exactly like `ToolCalculator` (same questions, actions, rewards and
`solve`), but a `calc:` action is a `POST /calc` to `url`, made from `astep` with `httpx` (pooled
connections, per-operation timeouts, and `RetryTransport`: retries with exponential backoff and
jitter on connection errors, timeouts, dropped connections and 5xx answers). A 4xx answer (a
malformed expression) is the policy's mistake: an `error: ...` observation, not retried. When every attempt
fails the observation is `error: tool unavailable (...)`, or, with `on_failure="raise"`,
`ToolUnavailable` is raised for the actor to count as an environment error.

Info keys of a tool call, besides tool_calculator's: retries (this call), http_status (last, or
None), http_error (the last connection error, timeout or 5xx met during this call, even when a
retry then succeeded; None when there was none), tool_latency_s.

`CalculatorService` (`headrace.env.calc_service`) is the server: loopback, port 0 by default (the
OS picks; read `url`), an asyncio loop in a background thread, started and stopped by the test or
example (also a context manager, and `python -m headrace.env.http_tool --port 8731` runs one in
the foreground). It can inject latency, 503 failures and dropped connections, at random rates or
scheduled for the next requests (`inject`), so that tests can show retries and timeouts.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import ssl
import threading
import time
import urllib.parse
import weakref
from typing import Any

import httpx

from headrace.env.base import EnvError, StepResult
from headrace.env.calc_service import MAX_BODY_BYTES, CalculatorService
from headrace.env.tool_calculator import TOOL_DISABLED, ToolCalculator

__all__ = ["MAX_BODY_BYTES", "CalculatorService", "HttpCalculator", "RetryTransport",
           "ToolClient", "ToolResponse", "ToolUnavailable", "local_service"]

class ToolUnavailable(RuntimeError):
    """Every attempt to call the tool failed (connection errors, timeouts or 5xx answers)."""


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


class _Exhausted(httpx.TransportError):
    """Every attempt failed in transport; carries the count and the last failure."""

    def __init__(self, failure: str, retries: int):
        super().__init__(failure)
        self.failure, self.retries = failure, retries


def _describe(error: BaseException) -> str:
    """`Type: message` of the deepest cause (ConnectionRefusedError rather than httpx's
    ConnectError wrapper), or of `error` itself when it has none."""
    root = error
    while root.__cause__ is not None or root.__context__ is not None:
        root = root.__cause__ or root.__context__
    root = root if isinstance(root, OSError) else error
    return f"{type(root).__name__}: {root}"


class RetryTransport(httpx.AsyncBaseTransport):
    """An httpx transport that retries what a retry can fix: connection errors, timeouts,
    dropped connections (`httpx.TransportError`) and 5xx answers, sleeping `backoff_s * 2**k`
    (capped at `backoff_max_s`, times a random factor in [0.5, 1]) before attempt k+1. A 4xx is
    returned at once. The response's `extensions` carry `retries` (attempts beyond the first)
    and `failure` (the last failure met, even when a retry then succeeded); when every attempt
    failed in transport it raises `_Exhausted` with both.

    httpx's own `AsyncHTTPTransport(retries=...)` retries only failed connects and does not say
    how many it made: this wraps one with `retries=0` (its pooling and timeouts stay).
    """

    def __init__(self, inner: httpx.AsyncBaseTransport, retries: int, backoff_s: float,
                 backoff_max_s: float, timeout_s: float, rng: random.Random):
        self.inner, self.retries = inner, retries
        self.backoff_s, self.backoff_max_s, self.timeout_s = backoff_s, backoff_max_s, timeout_s
        self._rng = rng

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        failure: str | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                delay = min(self.backoff_s * 2 ** (attempt - 1), self.backoff_max_s)
                await asyncio.sleep(delay * self._rng.uniform(0.5, 1.0))
            try:
                response = await self.inner.handle_async_request(request)
            except httpx.TimeoutException:
                failure = f"timeout after {self.timeout_s:g} s"
                continue
            except httpx.TransportError as error:
                failure = _describe(error)
                continue
            if response.status_code >= 500:
                failure = f"HTTP {response.status_code}"
                if attempt < self.retries:
                    await response.aclose()  # hands the connection back to the pool
                    continue
            response.extensions = {**response.extensions, "retries": attempt, "failure": failure}
            return response
        raise _Exhausted(failure or "no attempt made", self.retries)

    async def aclose(self) -> None:
        await self.inner.aclose()


_TLS: ssl.SSLContext | None = None


def _tls_context() -> ssl.SSLContext:
    """One default TLS context for every client: httpx would load the CA bundle for each
    transport (~60 ms here), which 100 environments' clients cannot afford."""
    global _TLS
    if _TLS is None:
        _TLS = ssl.create_default_context()
    return _TLS


class ToolClient:
    """Calls the calculator service over httpx: pooled connections (per event loop), per-operation
    timeouts (`timeout_s` for each connect, write, read and pool wait), and `RetryTransport`'s
    retries. Never raises for transport failures: the `ToolResponse` says what happened.

    An `httpx.AsyncClient` belongs to one event loop: each loop that calls gets its own, until
    `aclose` (from that loop) or `close`. The environment's proxy and .netrc settings are not
    read (`trust_env=False`; with a custom transport httpx ignores proxies anyway).
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
        self.url = f"http://{parts.netloc}"
        self.host, self.port = parts.hostname, parts.port
        self.timeout_s, self.retries = timeout_s, retries
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self._rng = random.Random(seed)
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            inner = httpx.AsyncHTTPTransport(retries=0, verify=_tls_context(), limits=httpx.Limits(
                max_connections=64, max_keepalive_connections=8))
            transport = RetryTransport(inner, self.retries, self.backoff_s, self.backoff_max_s,
                                       self.timeout_s, self._rng)
            client = httpx.AsyncClient(base_url=self.url, transport=transport, trust_env=False,
                                       timeout=httpx.Timeout(self.timeout_s))
            self._clients[loop] = client
        return client

    async def call(self, expr: str) -> ToolResponse:
        started = time.monotonic()
        try:
            async with self._client().stream("POST", "/calc", json={"expr": expr}) as response:
                retries, failure = response.extensions["retries"], response.extensions["failure"]
                status, body = response.status_code, b""
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_BODY_BYTES:  # a broken or hostile service
                        return ToolResponse(None, f"answer over {MAX_BODY_BYTES} bytes", status,
                                            retries, time.monotonic() - started, failure)
        except _Exhausted as error:
            return ToolResponse(None, error.failure, None, error.retries,
                                time.monotonic() - started, error.failure)
        except httpx.HTTPError as error:  # the body broke off after the headers: not retried
            failure = _describe(error)
            return ToolResponse(None, failure, None, 0, time.monotonic() - started, failure)
        try:
            payload = json.loads(body)
        except ValueError:
            payload = {}
        if not isinstance(payload, dict):
            payload = {}
        if status == 200 and isinstance(payload.get("result"), str):
            return ToolResponse(payload["result"], None, status, retries,
                                time.monotonic() - started, failure)
        message = failure if status >= 500 else payload.get("error")
        return ToolResponse(None, str(message or f"HTTP {status}")[:200], status, retries,
                            time.monotonic() - started, failure)

    async def aclose(self) -> None:
        """Closes the running loop's client and its connections."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    def close(self) -> None:
        """Closes the clients of loops that are not running (their connections go with them);
        a running loop's client is closed on that loop, soon."""
        for loop, client in list(self._clients.items()):
            self._clients.pop(loop, None)
            if loop.is_closed():
                continue
            if loop.is_running():
                loop.call_soon_threadsafe(lambda c=client: asyncio.ensure_future(c.aclose()))
            else:
                loop.run_until_complete(client.aclose())


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
        return asyncio.run(self._step_on_own_loop(action))

    async def _step_on_own_loop(self, action: str) -> StepResult:
        try:
            return await self.astep(action)
        finally:
            await self.client.aclose()  # the loop ends with this call: so do its connections

    def close(self) -> None:
        self.client.close()
        super().close()

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
