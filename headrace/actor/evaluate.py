"""Evaluation: play a fixed set of tasks once each with the sampler's current weights.

Uses the same episode runner and batched policy as acting, with greedy decoding (exact for
deterministic environments) or, on request, sampling as the actors do. The task set is the
environment's `eval_seeds()` when it offers one (guess_number plays every secret once), else
`range(10**9, 10**9 + episodes)`: seeds no actor uses (actors' streams start at
`headrace.env.registry.ACTOR_SEEDS_START`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from headrace.actor.episode import run_episode
from headrace.actor.policy import BatchedPolicy
from headrace.env.base import Env
from headrace.env.registry import ACTOR_SEEDS_START
from headrace.metrics.core import Metrics
from headrace.model.sampler import Sampler
from headrace.text.tokenizers import Tokenizer

EVAL_SEEDS_START = 10**9


def eval_seeds(env: Env, episodes: int) -> list[int]:
    """The held-out task seeds: the environment's own `eval_seeds()`, else `episodes` seeds
    from EVAL_SEEDS_START (below every actor's stream)."""
    seeds = getattr(env, "eval_seeds", None)
    if callable(seeds):
        return list(seeds())
    if not 0 < episodes <= ACTOR_SEEDS_START - EVAL_SEEDS_START:
        raise ValueError(f"episodes={episodes}: must be in [1, {ACTOR_SEEDS_START - EVAL_SEEDS_START}]")
    return list(range(EVAL_SEEDS_START, EVAL_SEEDS_START + episodes))


def evaluate(make_env: Callable[[], Env], tokenizer: Tokenizer, sampler: Sampler,
             seeds: list[int], step_timeout_s: float, max_batch: int, *, greedy: bool = True,
             on_episode: Callable[[], None] | None = None) -> dict[str, float]:
    """Returns success_rate, reward_mean, length_mean over `seeds` (blocking).

    Args:
      greedy: greedy decoding (the default); False: sampling as the sampler's settings say
        (temperature, top-k, top-p), as actors do.
      on_episode: called (on this thread) as each episode ends, e.g. to advance a progress bar.
    """
    metrics = Metrics()

    async def one(env: Env, seed: int, policy: BatchedPolicy):
        result = await run_episode(env, seed, policy, tokenizer, metrics, step_timeout_s)
        if on_episode is not None:
            on_episode()
        return result

    async def main():
        policy = BatchedPolicy(sampler, metrics, max_batch=max_batch, wait_s=0.05, greedy=greedy)
        server = asyncio.create_task(policy.serve())
        envs = [make_env() for _ in seeds]
        try:
            return await asyncio.gather(*[one(env, seed, policy)
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
