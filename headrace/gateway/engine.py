"""The seam between the gateway and what generates tokens.

The gateway needs four things of an engine: the longest context it takes, the most tokens one
call generates, a per-session handle (`open`), and `generate(context, n)` on that handle, which
returns n continuations of one context as (tokens, behaviour log-probs, policy version), the
log-probs under the temperature-scaled, untruncated distribution the learner evaluates. An engine
that can also give each token's likeliest alternatives says how many (`top_logprobs_max`, 0 or
absent: none) and takes `generate(context, n, top_logprobs=k)`, returning `Generation`s whose
`tops` are (ids int32[T, k], log-probs float32[T, k]) of that same distribution.
`PolicyEngine` is the built-in sampler behind the actor's `BatchedPolicy`, which batches the calls
of every concurrent session into one sampler call; an inference engine can replace it by giving
the same four things.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import NamedTuple, Protocol

import numpy as np

from headrace.actor.policy import BatchedPolicy
from headrace.model.sampler import TOP_LOGPROBS, PromptTooLong


class Generation(NamedTuple):
    """One continuation (an engine may also return a plain (tokens, logprobs, version))."""

    tokens: np.ndarray  # int32[T]
    logprobs: np.ndarray  # float32[T]
    version: int
    tops: tuple[np.ndarray, np.ndarray] | None = None  # (ids int32[T, k], log-probs f32[T, k])


class EngineSession(Protocol):
    async def generate(self, context: list[int], n: int = 1,
                       top_logprobs: int = 0) -> list[Generation]: ...

    def close(self) -> None: ...


class Engine(Protocol):
    max_new_tokens: int

    def max_context(self) -> int: ...

    def open(self) -> EngineSession: ...


class PolicySession:
    """One session on a `BatchedPolicy`: a live episode (with the sampler's kept-cache slot, if
    one is free) that counts as away (the batch does not wait for it) except while it calls."""

    def __init__(self, policy: BatchedPolicy):
        self.policy = policy
        self._stack = contextlib.ExitStack()
        self._closed = False
        self.slot = self._stack.enter_context(policy.episode())
        self._away = policy.stepping_away()
        self._away.__enter__()

    async def generate(self, context: list[int], n: int = 1,
                       top_logprobs: int = 0) -> list[Generation]:
        """n continuations; the first uses the session's kept cache, the others none (a slot
        holds one history). Raises PromptTooLong like `BatchedPolicy.act`.

        With `top_logprobs` the call runs the sampler's top-log-probs programs on its own (not
        batched with other sessions' calls: the batch's programs compute no alternatives), on a
        worker thread; the sampler serialises it with the batched calls, and the session stays
        away meanwhile, so batches do not wait for it."""
        if top_logprobs:
            return await self._generate_top(context, n, top_logprobs)
        if self._away is None:
            raise RuntimeError("generate on a closed session")
        self._away.__exit__(None, None, None)
        self._away = None
        try:
            slots = [self.slot] + [None] * (n - 1)
            return list(await asyncio.gather(*[self.policy.act(context, slot=s) for s in slots]))
        finally:
            if not self._closed:  # closed meanwhile (the session ended): nothing to re-enter
                self._away = self.policy.stepping_away()
                self._away.__enter__()

    async def _generate_top(self, context: list[int], n: int, k: int) -> list[Generation]:
        policy, sampler = self.policy, self.policy.sampler
        if self._closed:
            raise RuntimeError("generate on a closed session")
        if len(context) > sampler.max_context():
            raise PromptTooLong(f"context of {len(context)} tokens exceeds "
                                f"{sampler.max_context()}")
        slots = [self.slot] if n == 1 and self.slot is not None else None

        def call():
            if policy.sync is not None:  # newer weights first, as the batched calls do
                policy.sync.refresh(raise_error=False)
            return sampler.generate_top([context] * n, k, policy.greedy, slots)

        tokens, logps, tops, version = await asyncio.to_thread(call)
        return [Generation(t, lp, version, tp) for t, lp, tp in zip(tokens, logps, tops)]

    def close(self) -> None:
        """Releases the slot and the live count (idempotent; a call in flight finishes)."""
        if self._closed:
            return
        self._closed = True
        if self._away is not None:
            self._away.__exit__(None, None, None)
            self._away = None
        self._stack.close()


class PolicyEngine:
    """The built-in sampler, through the `BatchedPolicy` of the loop the gateway runs on."""

    top_logprobs_max = TOP_LOGPROBS

    def __init__(self, policy: BatchedPolicy):
        self.policy = policy
        self.max_new_tokens = policy.sampler.settings.max_new_tokens

    def max_context(self) -> int:
        return self.policy.sampler.max_context()

    def open(self) -> PolicySession:
        return PolicySession(self.policy)
