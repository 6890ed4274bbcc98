"""Synthetic microbatches and a small model whose dimensions divide by 8."""

from __future__ import annotations

import numpy as np

from headrace.config import LearnerConfig, LossConfig, OptimizerConfig
from headrace.learner.batching import Batch, Microbatch
from headrace.model.transformer import ModelDims

DIMS = ModelDims(vocab_size=64, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=128)


def learner_config(kind: str = "ppo_clip", kl_coef: float = 0.0, **optimizer) -> LearnerConfig:
    return LearnerConfig(loss=LossConfig(kind=kind), kl_coef=kl_coef, entropy_coef=0.01,
                         minibatches=2, groups_per_batch=2,
                         optimizer=OptimizerConfig(**{"lr": 1e-3, **optimizer}))


def microbatch_arrays(rng: np.random.Generator, rows: int, width: int,
                      vocab: int) -> dict[str, np.ndarray]:
    """Packed rows: up to two segments per row, then padding; weights not yet normalised."""
    shape = (rows, width)
    arrays = {"tokens": rng.integers(0, vocab, shape).astype(np.int32),
              "positions": np.zeros(shape, np.int32), "segment_ids": np.zeros(shape, np.int32),
              "behaviour_logprobs": (-np.log(vocab) + rng.normal(0, 0.5, shape)).astype(np.float32),
              "advantages": np.zeros(shape, np.float32), "weight": np.zeros(shape, np.float32)}
    for row in range(rows):
        offset = 0
        for segment in (1, 2):
            n = int(rng.integers(2, width // 2 + 1))
            cols = slice(offset, offset + n)
            arrays["positions"][row, cols] = np.arange(n)
            arrays["segment_ids"][row, cols] = segment
            arrays["advantages"][row, cols] = rng.normal()
            arrays["weight"][row, cols] = (np.arange(n) > 0) & (rng.random(n) < 0.8)
            offset += n
    return arrays


def make_batch(seed: int = 0, rows: int = 8, width: int = 16, vocab: int = DIMS.vocab_size,
               plan: tuple[int, ...] = (2, 1)) -> Batch:
    """`plan[i]` microbatches in minibatch i; weights normalised per minibatch (token mean)."""
    rng = np.random.default_rng(seed)
    microbatches = []
    for index, count in enumerate(plan):
        arrays = [microbatch_arrays(rng, rows, width, vocab) for _ in range(count)]
        total = sum(a["weight"].sum() for a in arrays)
        for k, a in enumerate(arrays):
            a["weight"] = (a["weight"] / total).astype(np.float32)
            microbatches.append(Microbatch(a, index, last=k == count - 1))
    tokens = sum(int((mb.arrays["segment_ids"] > 0).sum()) for mb in microbatches)
    return Batch(microbatches, len(plan), tokens, tokens, rows * width * len(microbatches), 0)
