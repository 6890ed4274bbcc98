"""Tokenizers for task vocabularies and raw bytes (JAX-free).

Every tokenizer reserves the same special ids: 0 pad, 1 beginning of sequence, 2 end of turn. A
`WordTokenizer` maps each word of an environment's declared vocabulary to one token (so an action
word is one token); a `ByteTokenizer` covers open text.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ("<pad>", "<bos>", "<eos>")


class TokenizerError(ValueError):
    """Text the tokenizer cannot encode (a word outside a closed vocabulary)."""


class WordTokenizer:
    """One token per whitespace-separated word of a closed vocabulary."""

    def __init__(self, vocabulary: Sequence[str]):
        words = list(SPECIALS) + [w for w in vocabulary if w not in SPECIALS]
        if len(set(words)) != len(words):
            raise TokenizerError("vocabulary has repeated words")
        self.words = tuple(words)
        self._ids = {w: i for i, w in enumerate(words)}

    @property
    def vocab_size(self) -> int:
        return len(self.words)

    def encode(self, text: str) -> np.ndarray:
        try:
            return np.array([self._ids[w] for w in text.split()], np.int32)
        except KeyError as error:
            raise TokenizerError(f"word {error.args[0]!r} is not in the task vocabulary") from None

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.words[i] for i in ids if i >= len(SPECIALS))

    def ids_of(self, words: Sequence[str]) -> tuple[int, ...]:
        return tuple(int(self._ids[w]) for w in words)


class ByteTokenizer:
    """UTF-8 bytes, offset past the special ids."""

    offset = len(SPECIALS)

    @property
    def vocab_size(self) -> int:
        return 256 + self.offset

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + self.offset

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(int(i) - self.offset for i in ids if i >= self.offset)
        return data.decode("utf-8", errors="replace")

    def ids_of(self, words: Sequence[str]) -> tuple[int, ...]:
        raise TokenizerError("a byte tokenizer has no word tokens; actions are open text")


Tokenizer = WordTokenizer | ByteTokenizer


def for_vocabulary(vocabulary: Sequence[str] | None) -> Tokenizer:
    """A word tokenizer for a declared vocabulary, else bytes."""
    return WordTokenizer(vocabulary) if vocabulary is not None else ByteTokenizer()
