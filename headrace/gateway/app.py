"""The gateway's HTTP surface: FastAPI routes on uvicorn, OpenAI-compatible.

Routes (every one also under `/sessions/{id}/v1/...`, the base URL an agent is handed):

- `POST /v1/chat/completions`: an OpenAI chat call (`headrace.gateway.service.Gateway.chat`);
  under a session it is recorded, without one it is only served. `stream: true` answers with
  Server-Sent Events (`headrace.gateway.streaming`).
- `GET /v1/models`: the one model served.
- `POST /sessions`: `{id, base_url, task, seed}`, for agents that run as their own processes (the
  runner's next waiting session, or with `headrace serve` a session without a task).
- `POST /sessions/{id}/reward`: `{reward}` or `{answer}` (scored by the session's task) ends it.
- `GET /health`.

Errors are OpenAI-shaped (`{"error": {...}}`): pydantic's validation errors become a 400 naming
the field, unknown routes a 404. Access: the server binds loopback unless told otherwise; with a
token (`token_env` names the environment variable holding it) every route but `/health` needs
`Authorization: Bearer TOKEN` (401 otherwise), and binding anything but loopback without one is
refused (`GatewayConfigError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import socket
import time

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from headrace.gateway.schemas import ChatRequest, RewardRequest, SessionRequest, error_body
from headrace.gateway.service import Gateway, GatewayError
from headrace.gateway.streaming import Stream

log = logging.getLogger(__name__)

SESSION_WAIT_S = 30.0  # POST /sessions waits this long for the runner's next session
STOP_GRACE_S = 5.0  # how long a stopping server lets its handlers send their 503s


class GatewayConfigError(ValueError):
    """The gateway cannot be served as configured (the message says which key, and why)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def create_app(gateway: Gateway, token: str = "") -> FastAPI:
    app = FastAPI(title="headrace gateway", docs_url=None, redoc_url=None, openapi_url=None)

    async def authorised(request: Request) -> None:
        if not token:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            gateway.metrics.count("gateway/unauthorised")
            raise GatewayError(401, "a bearer token is required (Authorization: Bearer TOKEN, "
                                    "the value of the gateway's token_env)",
                               "invalid_request_error", code="invalid_api_key")

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, error: GatewayError):
        return JSONResponse(error.body, status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        gateway.metrics.count("gateway/bad_requests")
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body')}: "
                            f"{e.get('msg')}" for e in error.errors()[:5])
        return JSONResponse(error_body(message or "malformed request", param=where or None),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {error.detail}",
                                       kind), status_code=error.status_code)

    auth = [Depends(authorised)]

    @app.get("/health")
    async def health():
        return {"ok": True}

    def models() -> dict:
        return {"object": "list", "data": [{"id": gateway.settings.model, "object": "model",
                                            "created": 0, "owned_by": "headrace"}]}

    @app.get("/v1/models", dependencies=auth)
    async def list_models():
        return models()

    @app.get("/sessions/{session_id}/v1/models", dependencies=auth)
    async def session_models(session_id: str):
        gateway.get(session_id)
        return models()

    async def serve_chat(session_id: str | None, body: ChatRequest):
        if body.stream:
            return EventStream(await gateway.stream(session_id, body))
        return await gateway.chat(session_id, body)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatRequest):
        return await serve_chat(None, body)

    @app.post("/sessions/{session_id}/v1/chat/completions", dependencies=auth)
    async def session_chat(session_id: str, body: ChatRequest):
        return await serve_chat(session_id, body)

    @app.post("/sessions", dependencies=auth)
    async def new_session(body: SessionRequest | None = None):
        gateway.refuse_if_stopping()
        if gateway.waiting is None:
            session = gateway.open_session()
        else:
            deadline = time.monotonic() + SESSION_WAIT_S
            while True:  # sessions that expired while waiting are skipped
                try:
                    session = await gateway.unless_stopped(asyncio.wait_for(
                        gateway.waiting.get(), max(deadline - time.monotonic(), 0.001)))
                except TimeoutError:
                    raise GatewayError(503, f"no task waited for an agent within "
                                            f"{SESSION_WAIT_S:g} s (admission may be holding the "
                                            "actor back); retry", "server_error",
                                       code="no_session") from None
                if not session.ended.is_set():
                    break
        session.last_active = time.monotonic()  # claimed: its idle clock starts now
        return {"id": session.id, "base_url": gateway.session_url(session),
                "task": session.task, "seed": session.seed}

    @app.post("/sessions/{session_id}/reward", dependencies=auth)
    async def reward(session_id: str, body: RewardRequest):
        return {"id": session_id, "reward": gateway.reward(session_id, body.reward, body.answer)}

    return app


class EventStream(StreamingResponse):
    """A streamed chat call as Server-Sent Events; the stream is closed however the response
    ends (sent, the client gone, the server stopping)."""

    def __init__(self, stream: Stream):
        super().__init__(stream.events(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.close()


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the process that hosts the gateway owns its signals
    (an actor's stop event, the CLI's Ctrl-C)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Server:
    """A gateway served by uvicorn on the running loop (`start`, then `stop`)."""

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0, token: str = ""):
        if not is_loopback(host) and not token:
            raise GatewayConfigError(f"host={host!r} exposes the gateway beyond this machine: set "
                                     "token_env to an environment variable holding a bearer "
                                     "token, or bind 127.0.0.1")
        self.gateway = gateway
        self.host = host
        config = uvicorn.Config(create_app(gateway, token), host=host, port=port,
                                log_level="warning", lifespan="off", access_log=False,
                                timeout_keep_alive=30,
                                # calls still in flight at stop are cancelled after this long
                                # (their sampler may already be gone: never wait for them)
                                timeout_graceful_shutdown=STOP_GRACE_S)
        self._server = _Server(config)
        self._tasks: list[asyncio.Task] = []
        self.port = 0

    async def start(self, timeout_s: float = 30.0) -> str:
        """Starts serving; returns the base URL (`http://HOST:PORT`).

        Raises:
          GatewayConfigError: the address cannot be bound (the message says which), or the
            server did not start within `timeout_s`.
        """
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP spelled out: asyncio turns Nagle off (TCP_NODELAY) only on sockets that
        # say so, and with Nagle every keep-alive reply waits ~40 ms for a delayed ACK
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:  # bound here, so a taken port is a clear error (uvicorn would exit the process)
            sock.bind((self.host, self._server.config.port))
        except OSError as error:
            sock.close()
            raise GatewayConfigError(f"the gateway cannot listen on {self.host}:"
                                     f"{self._server.config.port}: {error.strerror}; choose "
                                     "another port (0: any free one)") from None
        sock.listen(2048)
        sock.setblocking(False)
        serve = asyncio.create_task(self._server.serve(sockets=[sock]))
        self._tasks = [serve, asyncio.create_task(self.gateway.reap())]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._server.started:
            if serve.done() or loop.time() > deadline:
                await self.stop()
                raise GatewayConfigError(f"the gateway did not start on {self.host}:"
                                         f"{self._server.config.port} within {timeout_s:g} s")
            await asyncio.sleep(0.01)
        self.port = sock.getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.gateway.base_url = f"http://{host}:{self.port}"
        return self.gateway.base_url

    async def stop(self) -> None:
        self.gateway.shutdown()  # calls in flight answer 503; the server's graceful shutdown
        self._server.should_exit = True  # waits for those handlers to send them
        for task in self._tasks[1:]:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
