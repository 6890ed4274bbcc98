"""Greedy evaluation: play a fixed set of tasks once each with the sampler's current weights.

Uses the same episode runner and batched policy as acting, with greedy decoding (exact for
deterministic environments). The task set is the environment's `eval_seeds()` when it offers one
(guess_number plays every secret once), else `range(10**9, 10**9 + episodes)`: seeds no actor uses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from headrace.actor.episode import run_episode
from headrace.actor.policy import BatchedPolicy
from headrace.env.base import Env
from headrace.metrics.core import Metrics
from headrace.model.sampler import Sampler
from headrace.text.tokenizers import Tokenizer


def eval_seeds(env: Env, episodes: int) -> list[int]:
    seeds = getattr(env, "eval_seeds", None)
    return list(seeds()) if callable(seeds) else list(range(10**9, 10**9 + episodes))


def evaluate(make_env: Callable[[], Env], tokenizer: Tokenizer, sampler: Sampler,
             seeds: list[int], step_timeout_s: float, max_batch: int) -> dict[str, float]:
    """Returns success_rate, reward_mean, length_mean over `seeds` (blocking)."""
    metrics = Metrics()

    async def main():
        policy = BatchedPolicy(sampler, metrics, max_batch=max_batch, wait_s=0.05, greedy=True)
        server = asyncio.create_task(policy.serve())
        envs = [make_env() for _ in seeds]
        try:
            return await asyncio.gather(*[
                run_episode(env, seed, policy, tokenizer, metrics, step_timeout_s)
                for env, seed in zip(envs, seeds)])
        finally:
            server.cancel()
            policy.close()
            for env in envs:
                env.close()

    results = asyncio.run(main())
    return {"success_rate": float(np.mean([r.success for r in results])),
            "reward_mean": float(np.mean([r.reward for r in results])),
            "length_mean": float(np.mean([r.builder.length for r in results]))}
