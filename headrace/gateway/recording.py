"""Exact-token recording of a session's chat calls, as segments that become trajectories (JAX-free).

A session is one episode of an agent. Each chat call is rendered with the checkpoint's Jinja chat
template into a `SegmentRenderer` (a `JinjaRenderer` that also takes the agent's own messages):
tokens are only appended, and the sampled ones go in verbatim (loss mask 1, their behaviour
log-probs and policy version), so the context of every call is a prefix of the record and its
sampled tokens follow it at once. Each call is also kept as a `Call` (prompt ids, sampled ids).

History matching. A segment remembers its transcript: the messages of its last call and the
assistant message the gateway returned, in a normal form (`normal`: role, text, tool calls by
name and parsed arguments; ids and whitespace-only fields ignored). A new call whose messages
start with a segment's transcript (and whose tools are the same) extends that segment: only the
messages past the transcript are rendered, the earlier turns keep their recorded tokens and are
never re-tokenized. A call that matches no segment (the agent edited, dropped or reordered its
history, or changed its tools) starts a new segment rendered from its messages alone (counted as
`gateway/new_segments`); assistant turns the agent wrote itself are recorded as prompt (mask 0).
With `n` > 1 every further choice forks the segment (`gateway/branches`).

A call is rendered on a fork of the segment and committed only when its generation succeeds, so a
failed call (too long, cancelled) leaves the record as it was.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from headrace.gateway.schemas import Message, text_of
from headrace.text.episode import EpisodeBuilder
from headrace.text.jinja_render import JinjaRenderer
from headrace.text.jinja_template import JinjaChatTemplate

Normal = tuple  # a message in normal form (see `normal`)


def _arguments(value: str | dict[str, Any]) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def normal(message: Message | dict[str, Any]) -> Normal:
    """A message in the form history matching compares: (role, text, tool calls)."""
    if isinstance(message, dict):
        message = Message.model_validate(message)
    role = "system" if message.role == "developer" else message.role
    calls = tuple((c.function.name, _arguments(c.function.arguments))
                  for c in message.tool_calls or ())
    return role, text_of(message.content).strip(), calls


@dataclasses.dataclass
class Call:
    """One chat call as the sampler saw it: its context and what it sampled (exactly)."""

    prompt: np.ndarray  # int32 token ids given to the sampler
    sampled: np.ndarray  # int32 token ids kept (after max_tokens / stop truncation)
    logprobs: np.ndarray  # float32 behaviour log-probs of `sampled`
    version: int  # policy version that sampled them
    at: float  # unix time


class SegmentRenderer(JinjaRenderer):
    """A `JinjaRenderer` that also records the agent's own messages (any role, mask 0)."""

    def __init__(self, tokenizer, template: JinjaChatTemplate):
        super().__init__(tokenizer, template)
        self._sampled_at: set[int] = set()

    def _sampled(self, k: int) -> bool:
        return k in self._sampled_at

    def add_message(self, role: str, text: str, tool_calls: Sequence[tuple[str, str]] = ()) -> None:
        """Appends one of the agent's messages (its text escaped like an observation's).

        A system message gets the hermes tool block when tools use the fallback; assistant tool
        calls are written in the `<tool_call>` syntax the policy itself uses.
        """
        text = self._mark(text)
        if role == "system" and not self.messages:
            block = self.template.system_content()
            text = "\n\n".join(p for p in (text, block) if p)
        elif not self.messages and self.template.hermes:
            self.messages.append({"role": "system", "content": self.template.system_content()})
        if role == "assistant" and tool_calls:
            blocks = "\n".join(f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {args}}}'
                               "\n</tool_call>" for name, args in tool_calls)
            text = f"{text}\n{blocks}" if text else blocks
        self.messages.append(self.template.tool_message(text) if role == "tool"
                             else {"role": role, "content": text})
        self._prompted = False

    def add_generated(self, tokens, logprobs, version: int) -> None:
        self._sampled_at.add(len(self.messages))
        super().add_generated(tokens, logprobs, version)

    def fork(self) -> SegmentRenderer:
        """An independent copy (the tokenizer and template shared; they are immutable)."""
        other = copy.copy(self)
        other.builder = EpisodeBuilder()
        b, o = self.builder, other.builder
        o.tokens, o._mask, o._logps, o._versions = (list(b.tokens), list(b._mask), list(b._logps),
                                                     list(b._versions))
        o.turns = [dataclasses.replace(t) for t in b.turns]
        other.messages = list(self.messages)
        other.mismatches = list(self.mismatches)
        other._sampled_at = set(self._sampled_at)
        return other


@dataclasses.dataclass
class Segment:
    """One consistent history: its renderer, the transcript it matches, its calls."""

    renderer: SegmentRenderer
    tools_key: str
    transcript: list[Normal] = dataclasses.field(default_factory=list)
    calls: list[Call] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Pending:
    """A call being served: the fork it renders on, the context, and where it came from."""

    segment: Segment | None  # the segment it extends; None: a new segment
    renderer: SegmentRenderer
    context: list[int]
    transcript: list[Normal]
    tools_key: str


class Record:
    """The segments of one session (not thread-safe: the session's lock serialises its calls)."""

    def __init__(self, tokenizer, template: JinjaChatTemplate):
        self.tokenizer = tokenizer
        self.template = template
        self.segments: list[Segment] = []
        self.new_segments = 0  # segments started because no history matched (the first not)
        self.branches = 0  # segments started by choices past the first (n > 1)

    def _match(self, messages: list[Normal], tools_key: str) -> Segment | None:
        best = None
        for segment in self.segments:
            n = len(segment.transcript)
            if (segment.tools_key == tools_key and n < len(messages)
                    and messages[:n] == segment.transcript
                    and (best is None or n > len(best.transcript))):
                best = segment
        return best

    def prepare(self, messages: list[Message], tools: list[dict[str, Any]]) -> Pending:
        """Renders a call's messages on a fork of the segment they extend (or a new one).

        Raises:
          ChatTemplateError: the template cannot render the conversation.
        """
        normals = [normal(m) for m in messages]
        tools_key = json.dumps(tools, sort_keys=True)
        segment = self._match(normals, tools_key)
        if segment is None:
            template = dataclasses.replace(
                self.template, system="", tools=tuple(json.dumps(t) for t in tools))
            renderer, start = SegmentRenderer(self.tokenizer, template), 0
        else:
            renderer, start = segment.renderer.fork(), len(segment.transcript)
        for role, text, calls in normals[start:]:
            renderer.add_message(role, text, calls)
        return Pending(segment, renderer, list(renderer.prompt()), normals, tools_key)

    def commit(self, pending: Pending, choices: Sequence[tuple[Call, dict[str, Any]]]) -> None:
        """Records the served choices (each a call and the assistant message returned): the
        first extends its segment (or starts one: a new history), each further one a branch."""
        base = [] if pending.segment is None else list(pending.segment.calls)
        renderers = [pending.renderer] + [pending.renderer.fork() for _ in choices[1:]]
        for k, ((call, reply), renderer) in enumerate(zip(choices, renderers)):
            renderer.add_generated(call.sampled, call.logprobs, call.version)
            transcript = [*pending.transcript, normal(reply)]
            if k == 0 and pending.segment is not None:
                segment = pending.segment
                segment.renderer, segment.transcript = renderer, transcript
                segment.calls.append(call)
                continue
            if k > 0:
                self.branches += 1
            elif self.segments:
                self.new_segments += 1
            self.segments.append(Segment(renderer, pending.tools_key, transcript,
                                         [*base, call]))

    def builders(self) -> list[EpisodeBuilder]:
        """Each segment's record (segments without a call have none)."""
        return [s.renderer.builder for s in self.segments if s.calls]
