"""The gateway's sessions and chat calls, independent of HTTP (`headrace.gateway.app` serves them).

A `Gateway` owns the sessions of one engine. `chat(session_id, request)` serves one OpenAI chat
call: it checks the request, renders it into the session's record (`headrace.gateway.recording`),
asks the engine for `n` continuations, cuts each at `max_tokens` and `stop` (whole tokens: the
tokens kept are exactly those sampled, their log-probs unchanged), parses tool calls, records the
choices and returns the response body. `stream(session_id, request)` serves the same call as
Server-Sent Events (`headrace.gateway.streaming`), built and recorded by the same code. A call
without a session is served and not recorded (`gateway/unrecorded_calls`). `top_logprobs` are
served when the engine gives them (`top_logprobs_max`), built with the `logprobs` part
(`headrace.gateway.logprobs`).

Sampling. The behaviour log-probs must be those the learner evaluates, so every call is sampled
at the config's `temperature` and `top_p`. A request asking for other values (or `top_logprobs`,
penalties, a `tool_choice` that forces a call, more than `sampling.max_new_tokens`) is served at
the config's and counted (`gateway/overridden_sampling`, once per parameter), or refused with a
400 naming them when `strict`. `max_tokens` below the config's is honoured by cutting.

Failures, each an OpenAI-shaped error (`GatewayError`) and counted: a malformed request (400,
`gateway/bad_requests`), a tool schema the template cannot express (400), a template that cannot
render the conversation (400, `text/template_errors`), a context over the sampler's longest (400
`context_length_exceeded`, `gateway/too_long`), an unknown or ended session (404,
`gateway/unknown_session`). A session with no call in flight for
`session_timeout_s` expires (`gateway/session_timeouts`, logged): it ends with status error, and
its `on_expire` (the runner's: cancel the agent) runs.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from headrace.actor.episode import EpisodeResult
from headrace.gateway.engine import Engine, EngineSession
from headrace.gateway.logprobs import choice_logprobs
from headrace.gateway.recording import Call, Pending, Record
from headrace.gateway.schemas import ChatRequest, GatewayError, completion_body
from headrace.gateway.streaming import Stream
from headrace.gateway.tools import ToolSchemaError, check_tools, split_calls
from headrace.metrics.core import Metrics
from headrace.model.sampler import PromptTooLong
from headrace.text.jinja_template import ChatTemplateError, JinjaChatTemplate
from headrace.types import STATUS_ERROR, STATUS_OK

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Settings:
    model: str = "headrace"  # the model name `GET /v1/models` lists
    temperature: float = 1.0  # the config's sampling, which every call is served at
    top_p: float = 1.0
    strict: bool = False  # refuse other sampling parameters (400) instead of counting them
    session_timeout_s: float = 300.0


@dataclasses.dataclass
class Session:
    id: str
    record: Record
    engine: EngineSession
    task: Any = None  # what the agent is given (the runner's task), JSON-able for POST /sessions
    seed: int | None = None
    scorer: Callable[[str], float] | None = None  # POST reward {answer}: the task's score
    on_expire: Callable[[], None] | None = None
    started: float = dataclasses.field(default_factory=time.time)
    last_active: float = dataclasses.field(default_factory=time.monotonic)
    in_flight: int = 0
    reward: float | None = None
    status: str = STATUS_OK
    error: str | None = None
    ended: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    _rewarded: bool = False

    def results(self, success: bool | None = None) -> list[EpisodeResult]:
        """Each segment as an episode result carrying the session's reward (its last turn holds
        it; asked again, the same results)."""
        reward = float(self.reward or 0.0)
        timings = {"started": self.started, "finished": time.time()}
        out = []
        for builder in self.record.builders():
            if not self._rewarded:
                builder.reward_last_turn(reward)
            out.append(EpisodeResult(builder, reward, reward > 0 if success is None else success,
                                     self.status, self.error, dict(timings)))
        self._rewarded = True
        return out


def _cut_at_stop(tokenizer, tokens: np.ndarray, stops: list[str]) -> int | None:
    """The fewest leading tokens whose text holds a stop string (binary search over prefix
    decodes: the containment only grows with the prefix), or None."""
    if not stops or not any(s in tokenizer.decode(tokens) for s in stops):
        return None
    lengths = range(1, len(tokens) + 1)
    return lengths[bisect.bisect_left(
        lengths, True, key=lambda k: any(s in tokenizer.decode(tokens[:k]) for s in stops))]


class Gateway:
    """Sessions and chat calls on one engine (all on one asyncio loop)."""

    def __init__(self, engine: Engine, tokenizer, metrics: Metrics, settings: Settings):
        template = getattr(tokenizer, "template", None)
        if not isinstance(template, JinjaChatTemplate):
            raise ValueError("the gateway renders OpenAI messages with a checkpoint's Jinja chat "
                             "template: set model.init_from (hf:DIR or gguf:FILE) and "
                             "text.template: auto or FILE.jinja")
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = template
        self.metrics = metrics
        self.stopping = False  # `shutdown`: calls get 503 instead of a dropped connection
        self._calls: set[asyncio.Future] = set()  # engine calls in flight
        self.settings = settings
        self.sessions: dict[str, Session] = {}
        self.waiting: asyncio.Queue[Session] | None = None  # runner sessions for POST /sessions
        self.base_url = ""  # set once the server listens

    # --- sessions ---------------------------------------------------------------------------

    def open_session(self, task: Any = None, seed: int | None = None,
                     scorer: Callable[[str], float] | None = None,
                     counted: bool = True) -> Session:
        session = Session(uuid.uuid4().hex, Record(self.tokenizer, self.template),
                          self.engine.open(), task, seed, scorer)
        self.sessions[session.id] = session
        if counted:
            self.metrics.count("gateway/sessions")
        return session

    def session_url(self, session: Session) -> str:
        return f"{self.base_url}/sessions/{session.id}/v1"

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.ended.is_set():
            raise self._unknown(session_id)
        return session

    def _unknown(self, session_id: str) -> GatewayError:
        self.metrics.count("gateway/unknown_session")
        return GatewayError(404, f"session {session_id!r} is unknown or has ended; start one "
                                 "with POST /sessions (or use the base_url the runner gave)",
                            "not_found_error", code="session_not_found")

    def end(self, session: Session, reward: float | None = None, status: str = STATUS_OK,
            error: str | None = None) -> None:
        """Ends a session (idempotent: the first end wins) and releases its engine handle."""
        if session.ended.is_set():
            return
        session.reward = float(reward) if reward is not None else session.reward
        session.status, session.error = status, error
        session.ended.set()
        session.engine.close()
        self.metrics.count("gateway/new_segments", session.record.new_segments)
        self.metrics.count("gateway/branches", session.record.branches)
        mismatches = sum(len(s.renderer.mismatches) for s in session.record.segments)
        if mismatches:
            self.metrics.count("text/render_mismatch", mismatches)

    def reward(self, session_id: str, reward: float | None, answer: str | None) -> float:
        session = self.get(session_id)
        if (reward is None) == (answer is None):
            raise GatewayError(400, "give exactly one of `reward` (a number) or `answer` (text "
                                    "the session's task scores)", param="reward")
        if answer is not None:
            if session.scorer is None:
                raise GatewayError(400, "this session has no task to score an answer; give "
                                        "`reward`", param="answer")
            reward = float(session.scorer(answer))
        self.end(session, reward)
        return float(reward)

    def forget(self, session: Session) -> None:
        self.sessions.pop(session.id, None)

    def expire_idle(self) -> int:
        """Ends every session idle past `session_timeout_s` (status error); returns how many."""
        limit, now, n = self.settings.session_timeout_s, time.monotonic(), 0
        for session in list(self.sessions.values()):
            if (not session.ended.is_set() and not session.in_flight
                    and now - session.last_active > limit):
                n += 1
                self.metrics.count("gateway/session_timeouts")
                log.warning("gateway: session %s had no call for %.0f s: ended as an error",
                            session.id, limit)
                self.end(session, status=STATUS_ERROR,
                         error=f"session timed out: no call for {limit:g} s")
                if session.on_expire is not None:
                    session.on_expire()
        return n

    async def reap(self) -> None:
        """Expires idle sessions until cancelled."""
        every = min(1.0, self.settings.session_timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            self.expire_idle()

    # --- chat -------------------------------------------------------------------------------

    def _overrides(self, request: ChatRequest) -> list[str]:
        s, out = self.settings, []
        if request.temperature is not None and request.temperature != s.temperature:
            out.append(f"temperature={request.temperature} (served at {s.temperature})")
        if request.top_p is not None and request.top_p != s.top_p:
            out.append(f"top_p={request.top_p} (served at {s.top_p})")
        limit = request.max_completion_tokens or request.max_tokens
        if limit is not None and limit > self.engine.max_new_tokens:
            out.append(f"max_tokens={limit} (served at most {self.engine.max_new_tokens})")
        most = getattr(self.engine, "top_logprobs_max", 0)
        if request.logprobs and request.top_logprobs and request.top_logprobs > most:
            out.append(f"top_logprobs={request.top_logprobs} (served {most})")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(request, name):
                out.append(f"{name}={getattr(request, name)} (served at 0)")
        if request.tool_choice not in (None, "auto", "none"):
            out.append(f"tool_choice={request.tool_choice!r} (served as auto)")
        return out

    def refuse_if_stopping(self) -> None:
        if self.stopping:
            raise GatewayError(503, "the gateway is stopping (its run ended)", "server_error",
                               code="stopping")

    async def unless_stopped(self, awaitable):
        """Awaits `awaitable`, unless `shutdown` comes first: then a 503 (GatewayError).

        Once the gateway is stopping, every cancellation here is answered 503: `shutdown`'s
        own, and the server's when its graceful-shutdown window ends before this handler ran
        again (a loaded machine can starve the loop that long): a stopping gateway answers
        503, never a 500. A cancellation while serving (the client gone) is not ours to answer.
        """
        call = asyncio.ensure_future(awaitable)
        self._calls.add(call)
        try:
            return await call
        except asyncio.CancelledError:
            if not self.stopping:
                raise
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                task.uncancel()  # answered below instead of propagated
            self.refuse_if_stopping()
            raise
        finally:
            self._calls.discard(call)

    def shutdown(self) -> None:
        """Stops serving: engine calls in flight and any later call are answered 503 (an
        OpenAI-shaped server error the agent's client reports), none recorded."""
        self.stopping = True
        for call in list(self._calls):
            call.cancel()

    def _check(self, request: ChatRequest) -> list[dict[str, Any]]:
        """The request's sampling parameters (counted, or refused when strict) and its tools.

        Raises:
          GatewayError: strict and other sampling asked; top_logprobs without logprobs; a tool
            schema the template cannot express.
        """
        if request.top_logprobs and not request.logprobs:
            raise GatewayError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        overrides = self._overrides(request)
        if overrides and self.settings.strict:
            raise GatewayError(400, "sampling parameters differ from the run's (strict): "
                                    + "; ".join(overrides), param="temperature",
                               code="sampling_overridden")
        if overrides:
            self.metrics.count("gateway/overridden_sampling", len(overrides))
        try:
            return check_tools(request.tools) if request.tool_choice != "none" else []
        except ToolSchemaError as error:
            raise GatewayError(400, str(error), param="tools") from None

    def _top(self, request: ChatRequest) -> int:
        """Alternatives served per token: as asked, if the engine gives them (else counted)."""
        if not request.logprobs or not request.top_logprobs:
            return 0
        return min(request.top_logprobs, getattr(self.engine, "top_logprobs_max", 0))

    def _enter(self, session_id: str | None) -> tuple[Session, bool]:
        """The call's session (a temporary one without an id: served, not recorded), marked in
        flight; `_leave` undoes it."""
        self.refuse_if_stopping()
        if session_id is None:
            self.metrics.count("gateway/unrecorded_calls")
            return self.open_session(counted=False), False
        session = self.get(session_id)
        session.in_flight += 1
        return session, True

    def _leave(self, session: Session, recorded: bool) -> None:
        if recorded:
            session.in_flight -= 1
            session.last_active = time.monotonic()
        else:
            self.end(session)
            self.forget(session)

    async def chat(self, session_id: str | None, request: ChatRequest) -> dict[str, Any]:
        """Serves one chat call (see the module docstring); `stream` sends it as events.

        Raises:
          GatewayError: every refusal, OpenAI-shaped.
        """
        start = time.perf_counter()
        if request.stream:
            raise GatewayError(400, "stream=true is served by `stream`", param="stream")
        tools = self._check(request)
        session, recorded = self._enter(session_id)
        try:
            async with session.lock:
                pending = self._prepare(session, request, tools)
                generations = await self._generate(session, pending, request)
                return self._reply(session, pending, request, tools, generations, start,
                                   recorded, f"chatcmpl-{uuid.uuid4().hex[:24]}")
        finally:
            self._leave(session, recorded)

    async def stream(self, session_id: str | None, request: ChatRequest) -> Stream:
        """A streamed chat call (`headrace.gateway.streaming`): checked and rendered now, so a
        refusal is an HTTP error before any event; generated and recorded as the stream is sent.
        The session's lock is held until the stream's `close`.

        Raises:
          GatewayError: every refusal found before generation, as `chat`.
        """
        start = time.perf_counter()
        tools = self._check(request)
        session, recorded = self._enter(session_id)
        await session.lock.acquire()
        try:
            pending = self._prepare(session, request, tools)
        except BaseException:
            session.lock.release()
            self._leave(session, recorded)
            raise
        return Stream(self, session, recorded, request, tools, pending, start)

    def _prepare(self, session: Session, request: ChatRequest, tools) -> Pending:
        try:
            pending = session.record.prepare(request.messages, tools)
        except ChatTemplateError as error:
            self.metrics.count("text/template_errors")
            raise GatewayError(400, str(error), param="messages") from None
        limit = self.engine.max_context()
        if len(pending.context) > limit:
            self.metrics.count("gateway/too_long")
            raise GatewayError(400, f"the conversation is {len(pending.context)} tokens; this "
                                    f"model serves at most {limit} (the largest shapes.buckets "
                                    "entry minus sampling.max_new_tokens)", param="messages",
                               code="context_length_exceeded")
        return pending

    async def _generate(self, session: Session, pending: Pending, request: ChatRequest) -> list:
        if session.ended.is_set():  # ended since the call came in (a stream's, between its
            self.refuse_if_stopping()  # first event and generation; the run ending)
            raise self._unknown(session.id)
        engine_start = time.perf_counter()
        top = self._top(request)
        try:
            call = (session.engine.generate(pending.context, request.n, top_logprobs=top) if top
                    else session.engine.generate(pending.context, request.n))
            generations = await self.unless_stopped(call)
        except PromptTooLong as error:
            self.metrics.count("gateway/too_long")
            raise GatewayError(400, str(error), param="messages",
                               code="context_length_exceeded") from None
        self.metrics.observe("gateway/engine_s", time.perf_counter() - engine_start)
        return generations

    def _reply(self, session: Session, pending: Pending, request: ChatRequest, tools,
               generations, start: float, recorded: bool, request_id: str) -> dict:
        """The response body; the choices are recorded (committed) here."""
        max_tokens = request.max_completion_tokens or request.max_tokens
        stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        choices, records, completion = [], [], 0
        for index, generation in enumerate(generations):
            tokens, logps, version, *rest = generation
            choice, call, reply = self._choice(index, np.asarray(tokens), np.asarray(logps),
                                               rest[0] if rest else None, version, max_tokens,
                                               stops, request, tools, pending.context)
            choices.append(choice)
            records.append((call, reply))
            completion += len(call.sampled)
        session.record.commit(pending, records)
        self.metrics.count("gateway/requests")
        self.metrics.observe("gateway/request_s", time.perf_counter() - start)
        extra = {"session": session.id if recorded else None,
                 "policy_version": int(generations[0][2])}
        if getattr(request, "return_token_ids", None):
            extra["prompt_token_ids"] = [int(t) for t in pending.context]
            extra["token_ids"] = [[int(t) for t in c.sampled] for c, _ in records]
        return completion_body(request_id, request.model or self.settings.model, choices,
                               len(pending.context), completion, extra)

    def _choice(self, index, tokens, logps, tops, version, max_tokens, stops, request, tools,
                context) -> tuple[dict, Call, dict]:
        """One choice: its tokens cut at max_tokens / a stop string, text, tool calls."""
        finish = "length"
        stop_ids = self.tokenizer.stop_ids
        if len(tokens) and int(tokens[-1]) in stop_ids:
            finish = "stop"
        keep = len(tokens)
        if max_tokens is not None and len(tokens) > max_tokens:
            keep, finish = max_tokens, "length"
        cut = _cut_at_stop(self.tokenizer, tokens[:keep], stops)
        if cut is not None:
            keep, finish = cut, "stop"
        tokens, logps = tokens[:keep], logps[:keep]
        body = tokens[:-1] if len(tokens) and int(tokens[-1]) in stop_ids else tokens
        text = self.tokenizer.decode(body)
        if cut is not None:  # the text ends before the stop string, as OpenAI's does
            text = text[:min(text.find(s) for s in stops if s in text)]
        content, calls, errors = (split_calls(text) if tools else (text, [], []))
        if errors:
            self.metrics.count("gateway/tool_call_errors", len(errors))
        if calls:
            self.metrics.count("gateway/tool_calls", len(calls))
            finish = "tool_calls"
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choice = {"index": index, "message": message, "finish_reason": finish, "logprobs": None}
        if request.logprobs:
            kept_tops = None if tops is None else (np.asarray(tops[0])[:keep],
                                                   np.asarray(tops[1])[:keep])
            choice["logprobs"] = choice_logprobs(self.tokenizer, tokens, logps, kept_tops)
        call = Call(np.asarray(context, np.int32), np.asarray(tokens, np.int32),
                    np.asarray(logps, np.float32), int(version), time.time())
        return choice, call, message

