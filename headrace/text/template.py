"""Chat templates: how the turns of an episode become token ids, built incrementally (JAX-free).

An episode is a sequence of turns: an optional system prompt, the first observation (role user),
then policy turns (role assistant) and the observations that answer them (role user, or tool for
tool results). A `ChatTemplate` says which tokens frame each turn; an `EpisodeRenderer` applies it
turn by turn into an `EpisodeBuilder`, in the order the episode happens:

    renderer = EpisodeRenderer(tokenizer)          # the tokenizer carries its template
    renderer.add_observation(first_obs, first=True)
    context = renderer.prompt()                    # what the sampler is given
    renderer.add_generated(tokens, logprobs, version)
    renderer.add_observation(obs)                  # the environment's answer
    ...

Tokens are only ever appended. The generated tokens go in exactly as the sampler returned them
(never decoded and re-encoded), with loss mask 1; everything the template adds has loss mask 0. So
every context the sampler was given is a prefix of the recorded trajectory, and the generated
tokens follow it at once (tests/text/test_template.py checks this against a recording sampler).

Built-in templates (`text.template`), for the small word / byte vocabularies:

- `auto` (default): the checkpoint's own Jinja template when `model.init_from` names one (hf: or
  gguf:, see `headrace.text.checkpoint` and `headrace.text.jinja_render`), else `plain`.
- `plain`: `<bos>` and the first observation, then the generated tokens and observations
  back to back, with no markers. This is the rendering headrace has always used (guess_number's
  one-token turns stay one token).
- `chat`: every turn opens with a role token (`<|system|>`, `<|user|>`, `<|assistant|>`,
  `<|tool|>`: special tokens after the vocabulary, see `tokenizers`) and ends with `<eos>`. The
  `<|assistant|>` header is appended when the policy is asked to act (the "generation prompt"); a
  generated turn that did not end with `<eos>` (it hit `max_new_tokens`, or decoding is constrained
  to one action token) gets one, with loss mask 0, before the next turn.

`text.system` adds a system turn first (with `plain`: its tokens after `<bos>`). Later observations
take the role `text.observation_role` (user or tool). A template of your own is a `ChatTemplate`
instance named as `module:NAME` in `text.template`; a Jinja chat template of your own (with a
checkpoint's tokenizer) is a `FILE.jinja`.

`make_renderer` picks the renderer for a tokenizer's template: `EpisodeRenderer` for these,
`JinjaRenderer` for a Jinja template. Special ids come from the tokenizer (`eos_id`, `bos_id`,
`end_of_turn_id`), never from constants.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from headrace.config import ConfigError, TextConfig
from headrace.configtree import import_object
from headrace.text.checkpoint import (
    checkpoint_of,
    checkpoint_tokenizer,
    names_checkpoint,
    with_template,
)
from headrace.text.episode import EpisodeBuilder
from headrace.text.jinja_render import JinjaRenderer
from headrace.text.jinja_template import JinjaChatTemplate
from headrace.text.tokenizers import Tokenizer, TokenizerError, for_vocabulary
from headrace.types import ROLES, as_ints

ROLE_TOKENS = {role: f"<|{role}|>" for role in ROLES}


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """How turns are framed (see the module docstring). Frozen: one instance serves every episode.

    Raises:
      ValueError: `observation_role` is not user or tool.
    """

    name: str
    bos: bool = True  # the episode opens with <bos>
    role_tokens: bool = False  # each turn opens with its role's special token
    end_of_turn: bool = False  # <eos> closes every turn (added to a generated turn lacking it)
    system: str = ""  # system prompt opening every episode ("": none)
    observation_role: str = "user"  # role of the observations after the first

    def __post_init__(self):
        if self.observation_role not in ("user", "tool"):
            raise ValueError(f"observation_role={self.observation_role!r}: user or tool")

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The special tokens the tokenizer must reserve for this template."""
        return tuple(ROLE_TOKENS.values()) if self.role_tokens else ()


PLAIN = ChatTemplate("plain")
CHAT = ChatTemplate("chat", role_tokens=True, end_of_turn=True)
TEMPLATES: dict[str, ChatTemplate] = {"plain": PLAIN, "chat": CHAT}


def resolve(name: str) -> ChatTemplate:
    """The template for a built-in name or `module:NAME` (a `ChatTemplate` instance); `auto`
    without a checkpoint is `plain`.

    Raises:
      ConfigError: unknown name, module not importable, or the object is not a ChatTemplate.
    """
    if name == "auto":
        return PLAIN
    if name.endswith(".jinja"):
        raise ConfigError(f"text.template={name!r}: a Jinja template needs a checkpoint's "
                          "tokenizer (model.init_from: hf:DIR or gguf:FILE)")
    if name in TEMPLATES:
        return TEMPLATES[name]
    if ":" not in name:
        raise ConfigError(f"text.template={name!r}: not a built-in ({', '.join(TEMPLATES)}) and "
                          "not of the form module:NAME")
    module_name, _, attr = name.partition(":")
    template = import_object("text.template", name)
    if not isinstance(template, ChatTemplate):
        raise ConfigError(f"text.template={name!r}: {attr} in {module_name} is not a "
                          "headrace.text.template.ChatTemplate")
    return template


def from_config(config: TextConfig) -> ChatTemplate:
    """The configured template, with the config's system prompt and observation role."""
    return dataclasses.replace(resolve(config.template), system=config.system,
                               observation_role=config.observation_role)


def template_name(config: TextConfig, init_from: str = "") -> str:
    """The template a run renders with, by name (`auto` resolved: the checkpoint's, or plain;
    `init_from` may be a run folder, see `checkpoint_of`)."""
    checkpoint = checkpoint_of(init_from)
    if config.template == "auto":
        return f"auto:{checkpoint}" if checkpoint else "plain"
    return config.template


def make_tokenizer(vocabulary: Sequence[str] | None,
                   config: TextConfig | None = None, init_from: str = "") -> Tokenizer:
    """The tokenizer for an environment's vocabulary, with the configured template's special
    tokens reserved and the template attached; with a checkpoint (`init_from` hf: or gguf:), the
    checkpoint's tokenizer with its Jinja template (`headrace.text.checkpoint`).

    Raises:
      ConfigError: a bad template name, a system prompt the tokenizer cannot encode (a word
        outside a closed vocabulary), a checkpoint with an environment of closed vocabulary, or a
        checkpoint tokenizer or template that cannot be built.
    """
    config = config or TextConfig()
    init_from = checkpoint_of(init_from)  # a run folder: the checkpoint it started from, if any
    if names_checkpoint(init_from):
        if vocabulary is not None:
            raise ConfigError(f"model.init_from={init_from!r}: the environment declares a closed "
                              "vocabulary (one token per word), which a checkpoint's tokenizer "
                              "does not have; use an open-text environment")
        return with_template(checkpoint_tokenizer(init_from), config)
    if config.tools:
        raise ConfigError(f"text.tools={config.tools!r}: tool definitions are rendered by a "
                          "checkpoint's Jinja chat template (model.init_from: hf:DIR or "
                          "gguf:FILE); the built-in templates have no tool syntax")
    template = from_config(config)
    tokenizer = for_vocabulary(vocabulary, template.special_tokens, template)
    try:
        tokenizer.encode(template.system)
    except TokenizerError as error:
        raise ConfigError(f"text.system={template.system!r}: {error}; with a closed vocabulary "
                          "the system prompt may only use its words") from None
    return tokenizer


def template_of(tokenizer: Tokenizer) -> ChatTemplate | JinjaChatTemplate:
    """The template a tokenizer carries (plain when it carries none)."""
    return getattr(tokenizer, "template", None) or PLAIN


def make_renderer(tokenizer: Tokenizer, template: ChatTemplate | JinjaChatTemplate | None = None):
    """The renderer of one episode for the tokenizer's template (or `template`)."""
    template = template or template_of(tokenizer)
    if isinstance(template, JinjaChatTemplate):
        return JinjaRenderer(tokenizer, template)
    return EpisodeRenderer(tokenizer, template)


class EpisodeRenderer:
    """Renders one episode turn by turn with a template, into `self.builder` (an EpisodeBuilder).

    Not thread-safe; one renderer per episode.

    Raises (from the methods): TokenizerError when an observation cannot be encoded (a word outside
    a closed vocabulary); ValueError when turns come in an impossible order (generated tokens
    without a prompt under a role-token template).
    """

    mismatches: tuple = ()  # a built-in template always renders incrementally

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None = None):
        self.tokenizer = tokenizer
        self.template = template or template_of(tokenizer)
        self.builder = EpisodeBuilder()
        self._prompted = False  # the generation prompt for the next policy turn is in place
        t = self.template
        if t.role_tokens:
            self._role_ids = {role: tokenizer.special_id(token)
                              for role, token in ROLE_TOKENS.items()}

    def _framed(self, role: str, text: str) -> list[int]:
        """The tokens of a non-generated turn: header, content, end of turn."""
        t = self.template
        header = [self._role_ids[role]] if t.role_tokens else []
        closer = [self.tokenizer.end_of_turn_id] if t.end_of_turn else []
        return header + as_ints(self.tokenizer.encode(text)) + closer

    def _close_generated(self) -> None:
        """Ends a generated turn the sampler did not end with <eos> (template tokens, mask 0)."""
        if self.template.end_of_turn and self.builder.last_generated() \
                and self.builder.tokens[-1] != self.tokenizer.end_of_turn_id:
            self.builder.extend([self.tokenizer.end_of_turn_id])

    def add_observation(self, text: str, first: bool = False, role: str | None = None) -> None:
        """Appends an environment observation as a turn.

        Args:
          first: the episode's first observation (opens with <bos> and the system prompt, role
            user).
          role: overrides the role (default: user when first, else the template's
            observation_role).
        """
        t = self.template
        if first:
            if self.builder.length:
                raise ValueError("the first observation must come first")
            prefix = [self.tokenizer.bos_id] if t.bos else []
            if t.system:
                self.builder.open_turn("system", prefix + self._framed("system", t.system))
                prefix = []
            self.builder.open_turn(role or "user", prefix + self._framed("user", text))
        else:
            self._close_generated()
            role = role or t.observation_role
            self.builder.open_turn(role, self._framed(role, text))
        self._prompted = False

    def prompt(self) -> list[int]:
        """The context for the next policy turn: everything so far plus the template's generation
        prompt (the assistant header, recorded as the start of the assistant turn).

        Idempotent until `add_generated`: asking again does not add a second header.
        """
        if not self._prompted:
            self._close_generated()  # two policy turns in a row: the first is closed
            if self.template.role_tokens:
                self.builder.open_turn("assistant", [self._role_ids["assistant"]])
            self._prompted = True
        return self.builder.context()

    def add_generated(self, tokens: Sequence[int], logprobs: Sequence[float],
                      version: int) -> None:
        """Appends the sampler's tokens verbatim (loss mask 1); `prompt()` must have come first
        under a role-token template."""
        if self.template.role_tokens and not self._prompted:
            raise ValueError("add_generated before prompt(): the assistant header is missing")
        self.builder.add_generated(tokens, logprobs, version,
                                   continue_turn=self.template.role_tokens)
        self._prompted = False
