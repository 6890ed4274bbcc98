"""Incremental rendering of an episode with a checkpoint's Jinja chat template (JAX-free).

`JinjaRenderer` has `EpisodeRenderer`'s interface (`add_observation`, `prompt`, `add_generated`,
`builder`) and its guarantee: tokens are only appended, and the generated ones go in exactly as
sampled (loss mask 1), never decoded and re-encoded. Each time it needs tokens it renders the whole
conversation so far with the template (the assistant messages hold the generated text, decoded with
its special tokens) and appends the tokens of the text past what it already holds:

- a message's own text: the rendering of the conversation through it, past the text so far (for
  an assistant message that is its closing, e.g. `\\n` after a sampled `<|im_end|>`, or
  `<|im_end|>\\n` when the turn hit `max_new_tokens`);
- the generation prompt: the rendering with `add_generation_prompt`, past that.

So wherever the template renders a conversation's prefix as a prefix of its rendering (ChatML,
Llama 3, Qwen2.5 with tools), the recorded tokens equal `apply_chat_template(messages,
add_generation_prompt=True)`. Where it cannot, the turn is recorded in `mismatches` (the actor
counts them as `text/render_mismatch`) with the reason:

- `history`: the template rewrites earlier turns (Qwen3 drops past reasoning; a template that
  strips or reorders content): the rendering no longer starts with the text so far. The new turn
  is then rendered locally (the template's text past its own rendering of the shorter
  conversation) so the episode goes on.
- `tokens`: the text matches but its tokens do not: the sampler produced a non-canonical
  tokenization (BPE would spell the decoded text differently, e.g. a turn cut inside a UTF-8
  character), or the template's text joins across a turn boundary without a special token.

The check costs one tokenization of the conversation per policy turn (Rust, no Python loop).

Observation and system text cannot forge the template's control tokens: as transformers'
`apply_chat_template(..., sanitize_control_tokens=True)` does, every control token string in them
(the special tokens, and added tokens the template writes, such as `<tool_call>`) is wrapped in
private-use markers before rendering and encoded as plain text, without the markers
(`escaped` counts them; the actor reports `text/escaped_specials`).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Sequence

from headrace.text.episode import EpisodeBuilder
from headrace.text.jinja_template import ChatTemplateError, JinjaChatTemplate
from headrace.types import as_ints

MARK_START, MARK_END = "\U000f0000", "\U000f0001"  # transformers' control-token markers


@functools.lru_cache(maxsize=8)
def _control_patterns(tokens: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern]:
    """(a control token, a marked control token or a lone marker), longest tokens first."""
    alternatives = "|".join(map(re.escape, sorted(tokens, key=len, reverse=True))) or "(?!)"
    return (re.compile(alternatives),
            re.compile(f"{MARK_START}({alternatives}){MARK_END}|[{MARK_START}{MARK_END}]"))


class JinjaRenderer:
    """Renders one episode turn by turn with a `JinjaChatTemplate` (not thread-safe).

    Raises (from the methods): ChatTemplateError when the template cannot render the conversation
    (its `raise_exception`); ValueError when turns come in an impossible order.
    """

    def __init__(self, tokenizer, template: JinjaChatTemplate):
        self.tokenizer = tokenizer
        self.template = template
        self.builder = EpisodeBuilder()
        self.messages: list[dict[str, str]] = []
        self.mismatches: list[tuple[int, str]] = []  # (policy turn, reason) per mismatched turn
        self._text = ""  # the text the recorded tokens spell (specials written out)
        self._last_render = ""  # the template's own rendering of the conversation so far
        self._rendered = 0  # messages whose text is in the tokens
        self._prompted = False
        self._turn = 0  # policy turns so far
        self._eot_text = ""  # the end-of-turn token's text, when the last turn was sampled with it
        self.escaped = 0  # control token strings in observation / system text, kept as text
        controls = tuple(t for t in tokenizer.added_tokens
                         if t in tokenizer.specials or (t in template.source and not t.isspace()))
        self._control, self._marked = _control_patterns(controls)

    def _mark(self, text: str) -> str:
        """Wraps the control token strings of untrusted text in markers (dropping stray ones)."""
        text = text.replace(MARK_START, "").replace(MARK_END, "")
        marked, n = self._control.subn(f"{MARK_START}\\g<0>{MARK_END}", text)
        self.escaped += n
        return marked

    def _encode(self, text: str) -> list[int]:
        """Template text to ids: marked control tokens as plain text, the rest with its specials
        (pieces alternate text, marked token; a lone marker only splits)."""
        pieces = self._marked.split(text)
        ids = self.tokenizer.encode_markup(pieces[0]).tolist() if pieces[0] else []
        for i, piece in enumerate(pieces[1:], start=1):
            if piece:  # odd pieces are marked control tokens
                encode = self.tokenizer.encode if i % 2 else self.tokenizer.encode_markup
                ids.extend(encode(piece).tolist())
        return ids

    def add_observation(self, text: str, first: bool = False, role: str | None = None) -> None:
        """Appends an environment observation as a message (rendered at the next `prompt`).

        Args:
          first: the episode's first observation (after the system message, role user).
          role: overrides the role (default: user when first, else the template's
            observation_role); a `tool` result follows the template's tool format.
        """
        t = self.template
        if first:
            if self.messages:
                raise ValueError("the first observation must come first")
            system = t.system_content(escape=self._mark)
            if system is not None:
                self.messages.append({"role": "system", "content": system})
            self.messages.append({"role": role or "user", "content": self._mark(text)})
        else:
            role = role or t.observation_role
            text = self._mark(text)
            self.messages.append(t.tool_message(text) if role == "tool"
                                 else {"role": role, "content": text})
        self._prompted = False

    def _delta(self, rendered: str, generated: str | None = None) -> str:
        """The text of `rendered` past what the tokens hold. On a `history` mismatch: past the
        longest common prefix with the template's own rendering of the shorter conversation, and
        for an assistant message (`generated`: its content) past that content."""
        if rendered.startswith(self._text):
            return rendered[len(self._text):]
        if not self.mismatches or self.mismatches[-1] != (self._turn, "history"):
            self.mismatches.append((self._turn, "history"))
        common = len(os.path.commonprefix([rendered, self._last_render]))
        local = rendered[common:]
        if generated:  # keep only the closing after the (already sampled) content
            at = local.rfind(generated)
            local = local[at + len(generated):] if at >= 0 else local
        if generated is not None:
            if self._eot_text and local.startswith(self._eot_text):
                local = local[len(self._eot_text):]
        return local

    def _append(self, text: str, role: str | None) -> None:
        """Appends template text: a new turn of `role`, or (None) the end of the last turn."""
        tokens = self._encode(text) if text else []
        if role is None:
            self.builder.extend(tokens)
        else:
            self.builder.open_turn(role, tokens)
        self._text += text

    def _sampled(self, k: int) -> bool:
        """Whether message k holds sampled tokens (its text is already in the record)."""
        return self.messages[k]["role"] == "assistant"

    def prompt(self) -> list[int]:
        """The context for the next policy turn: every message so far and the template's
        generation prompt (recorded as the start of the assistant turn).

        Idempotent until `add_generated`.
        """
        if self._prompted:
            return self.builder.context()
        pending = range(self._rendered, len(self.messages))
        for k in pending:
            message = self.messages[k]
            try:
                rendered = self.template.render(self.messages[:k + 1])
            except ChatTemplateError:
                if k + 1 < len(self.messages):  # some templates cannot end on, e.g., a system
                    continue  # message: its text goes in with the next one's
                raise
            if self._sampled(k):  # its tokens are in: append its closing
                self._append(self._delta(rendered, message["content"]), None)
            else:
                self._append(self._delta(rendered), message["role"])
            self._last_render = rendered
            self._eot_text = ""
        self._rendered = len(self.messages)
        rendered = self.template.render(self.messages, add_generation_prompt=True)
        self._append(self._delta(rendered), "assistant")
        self._last_render = rendered
        self._prompted = True
        self._check_tokens(rendered)
        return self.builder.context()

    def _check_tokens(self, rendered: str) -> None:
        if self.mismatches and self.mismatches[-1][0] == self._turn:
            return  # this turn is already counted
        if self._encode(rendered) != self.builder.tokens:
            self.mismatches.append((self._turn, "tokens"))

    def add_generated(self, tokens: Sequence[int], logprobs: Sequence[float],
                      version: int) -> None:
        """Appends the sampler's tokens verbatim (loss mask 1) after `prompt()`; the assistant
        message holds their text (without a final stop token, which the template writes)."""
        if not self._prompted:
            raise ValueError("add_generated before prompt(): the generation prompt is missing")
        tokens = as_ints(tokens)
        self.builder.add_generated(tokens, logprobs, version, continue_turn=True)
        text = self.tokenizer.decode_markup(tokens)
        self._text += text
        stop = tokens[-1] if tokens and tokens[-1] in self.tokenizer.stop_ids else None
        content = self.tokenizer.decode_markup(tokens[:-1]) if stop is not None else text
        self._eot_text = text[len(content):] if text.startswith(content) else ""
        self.messages.append({"role": "assistant", "content": content})
        self._prompted = False
        self._turn += 1
