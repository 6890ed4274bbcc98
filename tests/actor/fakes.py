"""Fake environments for actor tests: one that raises, one that hangs, one that behaves."""

import asyncio

from headrace.env.base import Env, EnvSpec

WORDS = ("go", "a", "b", "ok")


class FlakyEnv(Env):
    """Seeds divisible by 3 raise on the first step, seeds = 1 mod 3 hang, the rest succeed."""

    spec = EnvSpec(vocabulary=WORDS, action_words=("a", "b"), max_turns=2)
    blocking = False

    def reset(self, seed):
        self.seed = seed
        return "go", {}

    def step(self, action):
        raise AssertionError("astep is used")

    async def astep(self, action):
        if self.seed % 3 == 0:
            raise RuntimeError("tool crashed")
        if self.seed % 3 == 1:
            await asyncio.sleep(60)
        return "ok", 1.0, True, False, {"success": True}
