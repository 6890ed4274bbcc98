"""Tokenizers for task vocabularies and raw bytes (JAX-free).

These tokenizers reserve the same special ids: 0 pad, 1 beginning of sequence, 2 end of turn. A
`WordTokenizer` maps each word of an environment's declared vocabulary to one token (so an action
word is one token); a `ByteTokenizer` covers open text.

A chat template may need more special tokens (role markers such as `<|user|>`): they are given as
`extra_specials`, get the ids after every ordinary token (so the ids of words and bytes never
move), are reachable only through `special_id` (never produced by `encode`, so observation text
cannot forge a role marker) and are dropped by `decode`. Like a Hugging Face tokenizer, a tokenizer
carries the chat template its special tokens belong to (`template`; None means the plain
template, see `headrace.text.template`).

Code outside this module reads the special ids from the tokenizer (`pad_id`, `bos_id`, `eos_id`,
`end_of_turn_id`, `stop_ids`), never as constants: a checkpoint's tokenizer
(`headrace.text.hf_tokenizer.HFTokenizer`) has its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ("<pad>", "<bos>", "<eos>")


class TokenizerError(ValueError):
    """Text the tokenizer cannot encode (a word outside a closed vocabulary), or an unknown
    special token."""


class _FixedIds:
    """The special ids every small tokenizer shares (the tokenizer protocol's names for them)."""

    pad_id, bos_id, eos_id = PAD, BOS, EOS
    end_of_turn_id = EOS  # what a generated turn ends with
    stop_ids = (EOS,)  # ids that end generation


class _Specials:
    """The template's extra special tokens, numbered from `base` on."""

    def __init__(self, names: Sequence[str], base: int, taken: Sequence[str] = ()):
        names = tuple(names)
        if len(set(names)) != len(names) or set(names) & set(taken):
            raise TokenizerError(f"extra special tokens {names} repeat each other or a word of the "
                                 "vocabulary")
        self.names = names
        self.base = base
        self.ids = {name: base + i for i, name in enumerate(names)}

    def id_of(self, name: str) -> int:
        if name in SPECIALS:
            return SPECIALS.index(name)
        try:
            return self.ids[name]
        except KeyError:
            raise TokenizerError(f"special token {name!r} is not in this tokenizer (it has "
                                 f"{', '.join(SPECIALS + self.names)})") from None


class WordTokenizer(_FixedIds):
    """One token per whitespace-separated word of a closed vocabulary."""

    def __init__(self, vocabulary: Sequence[str], extra_specials: Sequence[str] = (),
                 template: Any = None):
        words = list(SPECIALS) + [w for w in vocabulary if w not in SPECIALS]
        if len(set(words)) != len(words):
            raise TokenizerError("vocabulary has repeated words")
        self._specials = _Specials(extra_specials, len(words), words)
        self.words = tuple(words)
        self._ids = {w: i for i, w in enumerate(words)}
        self.template = template

    @property
    def vocab_size(self) -> int:
        return len(self.words) + len(self._specials.names)

    def encode(self, text: str) -> np.ndarray:
        try:
            return np.array([self._ids[w] for w in text.split()], np.int32)
        except KeyError as error:
            raise TokenizerError(f"word {error.args[0]!r} is not in the task vocabulary") from None

    def decode(self, ids: Sequence[int]) -> str:
        ids = ids.tolist() if isinstance(ids, np.ndarray) else ids  # Python ints index faster
        return " ".join(self.words[i] for i in ids if len(SPECIALS) <= i < len(self.words))

    def ids_of(self, words: Sequence[str]) -> tuple[int, ...]:
        return tuple(int(self._ids[w]) for w in words)

    def special_id(self, name: str) -> int:
        """The id of a special token (`<bos>`, `<eos>`, or one of `extra_specials`).

        Raises:
          TokenizerError: no such special token.
        """
        return self._specials.id_of(name)


class ByteTokenizer(_FixedIds):
    """UTF-8 bytes, offset past the special ids."""

    offset = len(SPECIALS)

    def __init__(self, extra_specials: Sequence[str] = (), template: Any = None):
        self._specials = _Specials(extra_specials, 256 + self.offset)
        self.template = template

    @property
    def vocab_size(self) -> int:
        return 256 + self.offset + len(self._specials.names)

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + self.offset

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(int(i) - self.offset for i in ids if self.offset <= i < self.offset + 256)
        return data.decode("utf-8", errors="replace")

    def ids_of(self, words: Sequence[str]) -> tuple[int, ...]:
        raise TokenizerError("a byte tokenizer has no word tokens; actions are open text")

    def special_id(self, name: str) -> int:
        """The id of a special token (`<bos>`, `<eos>`, or one of `extra_specials`).

        Raises:
          TokenizerError: no such special token.
        """
        return self._specials.id_of(name)


class Tokenizer(Protocol):
    """What the actor, the renderers, the sampler settings and `headrace sft` use of a tokenizer:
    `WordTokenizer`, `ByteTokenizer`, and a checkpoint's `headrace.text.hf_tokenizer.HFTokenizer`
    (which adds `encode_markup` / `decode_markup` for template-rendered text)."""

    pad_id: int
    bos_id: int | None
    eos_id: int | None
    end_of_turn_id: int | None
    template: Any  # the chat template it carries (None: plain)

    @property
    def vocab_size(self) -> int: ...

    @property
    def stop_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def ids_of(self, words: Sequence[str]) -> tuple[int, ...]: ...

    def special_id(self, name: str) -> int: ...


def for_vocabulary(vocabulary: Sequence[str] | None, extra_specials: Sequence[str] = (),
                   template: Any = None) -> Tokenizer:
    """A word tokenizer for a declared vocabulary, else bytes (with a template's specials)."""
    if vocabulary is not None:
        return WordTokenizer(vocabulary, extra_specials, template)
    return ByteTokenizer(extra_specials, template)
