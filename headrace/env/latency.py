"""A wrapper that adds realistic latency to every environment step (fixed, lognormal or a trace).

The delay is awaited with `asyncio.sleep`, so thousands of delayed episodes wait concurrently in one
actor without threads.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time

from headrace.config import LatencyConfig
from headrace.env.base import Env, StepResult


class LatencySampler:
    """Draws per-step delays in seconds; `trace` replays a measured list in a loop."""

    def __init__(self, config: LatencyConfig, seed: int = 0):
        self.config = config
        self._rng = random.Random(seed)
        self._trace = itertools.cycle(config.trace) if config.trace else None

    def __call__(self) -> float:
        kind = self.config.kind
        if kind == "fixed":
            return self.config.seconds
        if kind == "lognormal":
            return self.config.seconds * self._rng.lognormvariate(0.0, self.config.sigma)
        if kind == "trace":
            return next(self._trace)
        return 0.0


class LatencyWrapper(Env):
    """Delays each step of `inner` by a drawn latency, then answers as `inner` does."""

    def __init__(self, inner: Env, delay: LatencySampler):
        self.inner = inner
        self.delay = delay
        self.spec = inner.spec
        self.blocking = inner.blocking

    def reset(self, seed: int):
        return self.inner.reset(seed)

    def step(self, action: str) -> StepResult:
        time.sleep(self.delay())
        return self.inner.step(action)

    async def astep(self, action: str) -> StepResult:
        await asyncio.sleep(self.delay())
        if self.inner.has_astep:
            return await self.inner.astep(action)
        if self.inner.blocking:
            return await asyncio.to_thread(self.inner.step, action)
        return self.inner.step(action)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name):
        return getattr(self.inner, name)
