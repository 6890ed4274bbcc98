"""Incremental recording of a multi-turn episode as token ids (JAX-free).

The builder appends whole turns: observation/prompt tokens (loss mask 0) as the tokenizer encodes
them, and generated tokens exactly as the sampler produced them (loss mask 1, with their behaviour
log-probs and policy version). Generated tokens are never decoded and re-encoded, so the record is
exactly the sequence the policy saw and produced.
"""

from __future__ import annotations

import numpy as np

from headrace.types import Turn


class EpisodeBuilder:
    def __init__(self):
        self._tokens: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self._logps: list[np.ndarray] = []
        self._versions: list[np.ndarray] = []
        self.turns: list[Turn] = []
        self.length = 0
        self._context: np.ndarray | None = None

    def _append(self, tokens, mask, logps, versions, role: str, reward: float = 0.0) -> None:
        n = len(tokens)
        self._tokens.append(np.asarray(tokens, np.int32))
        self._mask.append(mask)
        self._logps.append(logps)
        self._versions.append(versions)
        self.turns.append(Turn(self.length, self.length + n, role, reward))
        self.length += n
        self._context = None

    def add_observation(self, tokens: np.ndarray, role: str = "user") -> None:
        n = len(tokens)
        self._append(tokens, np.zeros(n, bool), np.zeros(n, np.float32), np.full(n, -1, np.int32),
                     role)

    def add_generated(self, tokens: np.ndarray, logprobs: np.ndarray, version: int) -> None:
        n = len(tokens)
        self._append(tokens, np.ones(n, bool), np.asarray(logprobs, np.float32),
                     np.full(n, version, np.int32), "assistant")

    def reward_last_turn(self, reward: float) -> None:
        self.turns[-1].reward += float(reward)

    def context(self) -> np.ndarray:
        """All tokens so far (what the policy conditions on next)."""
        if self._context is None:
            self._context = (np.concatenate(self._tokens) if self._tokens
                             else np.zeros(0, np.int32))
        return self._context

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(tokens int32, loss_mask bool, behaviour_logprobs float32, policy_version int32)."""
        if not self._tokens:
            empty = np.zeros(0)
            return (empty.astype(np.int32), empty.astype(bool), empty.astype(np.float32),
                    empty.astype(np.int32))
        return (self.context(), np.concatenate(self._mask), np.concatenate(self._logps),
                np.concatenate(self._versions))
