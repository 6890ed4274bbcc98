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

Built-in templates (`text.template`):

- `plain` (default): `<bos>` and the first observation, then the generated tokens and observations
  back to back, with no markers. This is the rendering headrace has always used (guess_number's
  one-token turns stay one token).
- `chat`: every turn opens with a role token (`<|system|>`, `<|user|>`, `<|assistant|>`,
  `<|tool|>`: special tokens after the vocabulary, see `tokenizers`) and ends with `<eos>`. The
  `<|assistant|>` header is appended when the policy is asked to act (the "generation prompt"); a
  generated turn that did not end with `<eos>` (it hit `max_new_tokens`, or decoding is constrained
  to one action token) gets one, with loss mask 0, before the next turn.

`text.system` adds a system turn first (with `plain`: its tokens after `<bos>`). Later observations
take the role `text.observation_role` (user or tool). A template of your own is a `ChatTemplate`
instance named as `module:NAME` in `text.template`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from headrace.config import ConfigError, TextConfig, import_object
from headrace.text.episode import EpisodeBuilder
from headrace.text.tokenizers import BOS, EOS, Tokenizer, TokenizerError, for_vocabulary
from headrace.types import ROLES

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
    """The template for a built-in name or `module:NAME` (a `ChatTemplate` instance).

    Raises:
      ConfigError: unknown name, module not importable, or the object is not a ChatTemplate.
    """
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


def make_tokenizer(vocabulary: Sequence[str] | None,
                   config: TextConfig | None = None) -> Tokenizer:
    """The tokenizer for an environment's vocabulary, with the configured template's special
    tokens reserved and the template attached.

    Raises:
      ConfigError: a bad template name, or a system prompt the tokenizer cannot encode (a word
        outside a closed vocabulary).
    """
    template = from_config(config or TextConfig())
    tokenizer = for_vocabulary(vocabulary, template.special_tokens, template)
    try:
        tokenizer.encode(template.system)
    except TokenizerError as error:
        raise ConfigError(f"text.system={template.system!r}: {error}; with a closed vocabulary "
                          "the system prompt may only use its words") from None
    return tokenizer


def template_of(tokenizer: Tokenizer) -> ChatTemplate:
    """The template a tokenizer carries (plain when it carries none)."""
    return getattr(tokenizer, "template", None) or PLAIN


class EpisodeRenderer:
    """Renders one episode turn by turn with a template, into `self.builder` (an EpisodeBuilder).

    Not thread-safe; one renderer per episode.

    Raises (from the methods): TokenizerError when an observation cannot be encoded (a word outside
    a closed vocabulary); ValueError when turns come in an impossible order (generated tokens
    without a prompt under a role-token template).
    """

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
        closer = [EOS] if t.end_of_turn else []
        return header + [int(x) for x in self.tokenizer.encode(text)] + closer

    def _close_generated(self) -> None:
        """Ends a generated turn the sampler did not end with <eos> (template tokens, mask 0)."""
        if self.template.end_of_turn and self.builder.last_generated() \
                and self.builder.tokens[-1] != EOS:
            self.builder.extend([EOS])

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
            prefix = [BOS] if t.bos else []
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
