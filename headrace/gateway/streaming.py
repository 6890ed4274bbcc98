"""`stream: true`: a chat completion as Server-Sent Events, in the OpenAI chunk shape.

The built-in sampler generates a whole reply in one device call (its decode loop runs on the
device and returns every token at once; streaming tokens as they are produced would need a host
callback per token inside that loop, a host-device sync per token). So a streamed call sends:

1. at once, before generation: per choice a `chat.completion.chunk` with `delta: {role:
   "assistant", content: ""}` (the client sees the call accepted; a client that disconnects
   while its reply is generated cancels the call, and nothing is recorded);
2. when the generation returns, per choice: one content delta (the whole text, with its
   `logprobs` when asked), for each tool call a delta naming it (`id`, `function.name`) and one
   carrying its arguments, then an empty delta with `finish_reason`;
3. with `stream_options: {include_usage: true}`, a chunk with `choices: []` and `usage` (every
   chunk before it has `usage: null`);
4. `data: [DONE]`.

The last chunk carries the `headrace` object of the non-streamed response (session, policy
version, and with `return_token_ids` the exact tokens). The reply is built, and recorded, by the
same code as a non-streamed call's (`headrace.gateway.service`), so the record is the same. An
error after the stream began (the gateway stopping, the engine refusing the context) is sent as
an event `{"error": {...}}`, which the `openai` client raises as `APIError`.

A client that disconnects: before the reply was generated, the call is cancelled and the record
is as it was; after (while the chunks are sent), the reply stays recorded, as a non-streamed
reply whose response was lost (the agent's next call then does not continue it: a new segment,
counted as such). Either way the record holds exactly what was sampled; each such stream is
counted (`gateway/stream_disconnects`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from headrace.gateway.schemas import GatewayError

log = logging.getLogger(__name__)


def sse(payload: dict[str, Any] | str) -> str:
    """One Server-Sent Event (`data: ...` and a blank line)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


DONE = sse("[DONE]")


class Chunks:
    """The chunks of one streamed call (`first` before generation, `reply` after)."""

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool):
        self.base = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                     "model": model, "system_fingerprint": None}
        if include_usage:
            self.base["usage"] = None
        self.include_usage = include_usage

    def _chunk(self, index: int, delta: dict[str, Any], logprobs: Any = None,
               finish: str | None = None) -> dict[str, Any]:
        return {**self.base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                          "finish_reason": finish}]}

    def first(self, n: int) -> list[dict[str, Any]]:
        return [self._chunk(i, {"role": "assistant", "content": ""}) for i in range(n)]

    def reply(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks carrying a `chat.completion` body's choices, usage and `headrace` object."""
        out = []
        for choice in body["choices"]:
            i, message = choice["index"], choice["message"]
            if message.get("content") or choice["logprobs"] is not None:
                out.append(self._chunk(i, {"content": message.get("content") or ""},
                                       choice["logprobs"]))
            for j, call in enumerate(message.get("tool_calls") or ()):
                function = call["function"]
                out.append(self._chunk(i, {"tool_calls": [
                    {"index": j, "id": call["id"], "type": "function",
                     "function": {"name": function["name"], "arguments": ""}}]}))
                out.append(self._chunk(i, {"tool_calls": [
                    {"index": j, "function": {"arguments": function["arguments"]}}]}))
            out.append(self._chunk(i, {}, None, choice["finish_reason"]))
        if self.include_usage:
            out.append({**self.base, "choices": [], "usage": body["usage"]})
        out[-1] = {**out[-1], "headrace": body["headrace"]}
        return out


class Stream:
    """One streamed call on a gateway (`Gateway.stream` made it: the request checked, rendered
    on a fork as `pending`, the session's lock held). `events` generates and sends it, and
    closes it before its last event; `close` (always, once the response ends, however it ends;
    idempotent) releases the lock."""

    def __init__(self, gateway, session, recorded: bool, request, tools, pending, start: float):
        self.gateway, self.session, self.recorded = gateway, session, recorded
        self.request, self.tools, self.pending, self.start = request, tools, pending, start
        include = bool(request.stream_options and request.stream_options.include_usage)
        self.chunks = Chunks(f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()),
                             request.model or gateway.settings.model, include)
        self.finished = False
        self._closed = False

    async def events(self) -> AsyncIterator[str]:
        for chunk in self.chunks.first(self.request.n):
            yield sse(chunk)
        gateway = self.gateway
        try:
            generations = await gateway._generate(self.session, self.pending, self.request)
            body = gateway._reply(self.session, self.pending, self.request, self.tools,
                                  generations, self.start, self.recorded,
                                  self.chunks.base["id"])
        except GatewayError as error:  # the stream began: the error is an event
            yield sse(error.body)
            self.finished = True
            return
        for chunk in self.chunks.reply(body):
            yield sse(chunk)
        # Released before the last event: a client that has read [DONE] finds the session free
        # (a temporary one gone), not still held until the response's close runs.
        self.finished = True
        self.close()
        yield DONE

    def close(self) -> None:
        """Releases the session (idempotent); counts a stream that did not finish."""
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self.gateway.metrics.count("gateway/stream_disconnects")
            log.info("gateway: a streamed call in session %s ended before its last event (the "
                     "client went away)", self.session.id)
        self.session.lock.release()
        self.gateway._leave(self.session, self.recorded)
