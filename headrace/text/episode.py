"""Incremental recording of a multi-turn episode as token ids (JAX-free).

The builder appends whole turns: observation/prompt tokens (loss mask 0) as the tokenizer encodes
them, and generated tokens exactly as the sampler produced them (loss mask 1, with their behaviour
log-probs and policy version). Generated tokens are never decoded and re-encoded, so the record is
exactly the sequence the policy saw and produced. Per-token data is kept in Python lists while the
episode runs (appending is the hot path) and becomes arrays once, in `arrays()`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from headrace.types import Turn


class EpisodeBuilder:
    def __init__(self):
        self.tokens: list[int] = []
        self._mask: list[bool] = []
        self._logps: list[float] = []
        self._versions: list[int] = []
        self.turns: list[Turn] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def add_observation(self, tokens: Sequence[int], role: str = "user") -> None:
        n = len(tokens)
        self.turns.append(Turn(self.length, self.length + n, role))
        self.tokens.extend(int(t) for t in tokens)
        self._mask.extend([False] * n)
        self._logps.extend([0.0] * n)
        self._versions.extend([-1] * n)

    def add_generated(self, tokens: Sequence[int], logprobs: Sequence[float], version: int) -> None:
        n = len(tokens)
        self.turns.append(Turn(self.length, self.length + n, "assistant"))
        self.tokens.extend(int(t) for t in tokens)
        self._mask.extend([True] * n)
        self._logps.extend(float(x) for x in logprobs)
        self._versions.extend([version] * n)

    def reward_last_turn(self, reward: float) -> None:
        self.turns[-1].reward += float(reward)

    def context(self) -> list[int]:
        """All tokens so far (what the policy conditions on next)."""
        return self.tokens

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(tokens int32, loss_mask bool, behaviour_logprobs float32, policy_version int32)."""
        return (np.array(self.tokens, np.int32), np.array(self._mask, bool),
                np.array(self._logps, np.float32), np.array(self._versions, np.int32))
