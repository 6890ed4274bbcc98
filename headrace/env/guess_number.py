"""guess_number: find a secret in 1..N with higher/lower hints within T guesses.

Reward 1 when the guess is right, minus `turn_penalty` per guess taken; 0 when the guesses run out
or an action is not a number in 1..N (counted as an invalid action, which ends the episode). A
uniform random policy succeeds about 16 % of the time at N=32, T=5; bisection wins 31/32.
"""

from __future__ import annotations

from typing import Any

from headrace.env.base import Env, EnvError, EnvSpec, StepResult

OBSERVATIONS = ("start", "higher", "lower", "correct")
_MASK64 = (1 << 64) - 1


class GuessNumber(Env):
    blocking = False  # pure computation, microseconds: run inline on the event loop

    def __init__(self, n: int = 32, max_turns: int = 5, turn_penalty: float = 0.01):
        if n < 2:
            raise EnvError(f"guess_number: n={n} must be >= 2")
        if max_turns < 1:
            raise EnvError(f"guess_number: max_turns={max_turns} must be >= 1")
        self.n = n
        self.max_turns = max_turns
        self.turn_penalty = turn_penalty
        numbers = tuple(str(i) for i in range(1, n + 1))
        self.spec = EnvSpec(vocabulary=OBSERVATIONS + numbers, action_words=numbers,
                            max_turns=max_turns)
        self._secret = 0
        self._turns = 0

    def secret_for(self, seed: int) -> int:
        """The task's secret: a fixed, well-mixed function of the seed (splitmix64)."""
        z = (seed + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return (z ^ (z >> 31)) % self.n + 1

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self._secret = self.secret_for(seed)
        self._turns = 0
        return "start", {}

    def step(self, action: str) -> StepResult:
        self._turns += 1
        text = action.strip()
        if not text.isdigit() or not 1 <= int(text) <= self.n:
            return "", 0.0, True, False, {"invalid_action": True, "success": False}
        guess = int(text)
        if guess == self._secret:
            return "correct", 1.0 - self.turn_penalty, True, False, {"success": True}
        truncated = self._turns >= self.max_turns
        hint = "higher" if self._secret > guess else "lower"
        return hint, -self.turn_penalty, False, truncated, {"success": False}

    def eval_seeds(self) -> list[int]:
        """Seeds whose secrets are exactly 1..N once each (greedy evaluation plays every secret)."""
        seeds: dict[int, int] = {}
        seed = 0
        while len(seeds) < self.n:
            seeds.setdefault(self.secret_for(seed), seed)
            seed += 1
        return [seeds[s] for s in sorted(seeds)]
