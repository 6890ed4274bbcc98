"""A deterministic corpus of awkward strings for tokenizer equality tests."""

from __future__ import annotations

import numpy as np

PIECES = (
    "hello", "Hello", " world", "The", " capital", "of", "France", "Paris", "don't", "I'm",
    "café", "naïve", "Ünïcödé", "中文", "日本語のテキスト", "한국어", "مرحبا", "עברית", "Ελληνικά",
    "🎉", "👩‍💻", "🇫🇷", "e\u0301", "\u200b", "\ufeff", "ß", "ﬁ", "Ⅻ",
    "0", "7", "42", "123456789", "3.14159", "-17", "1,000,000", "0x1F", "2026-12-01",
    " ", "  ", "    ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\t\t  \n",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<|im_start",
    "{", "}", '{"name": "add", "arguments": {"a": 1}}', "def f(x):\n    return x", "```",
    "!", "?", "...", "—", "'", '"', "\\", "/", "#", "$", "%", "&", "*", "@", "~", "`", "^",
)


def corpus(n: int = 1000, seed: int = 0) -> list[str]:
    """`n` strings: the empty one, each piece alone, then random concatenations of 1-12 pieces,
    and a few long ones (a few thousand characters)."""
    rng = np.random.default_rng(seed)
    out = ["", *PIECES]
    long_count = 5
    while len(out) < n - long_count:
        k = int(rng.integers(1, 13))
        out.append("".join(PIECES[i] for i in rng.integers(0, len(PIECES), k)))
    for _ in range(long_count):
        out.append("".join(PIECES[i] for i in rng.integers(0, len(PIECES), 600)))
    return out[:n]
