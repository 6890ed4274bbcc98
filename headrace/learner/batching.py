"""From groups to fixed-shape training batches (host side, NumPy).

One learner step consumes `groups_per_batch` groups as `minibatches` optimizer updates: the batch
arrays have shape [M, R, L] with M minibatches of R rows, L a bucket of the length ladder, so the
train step compiles once per bucket. Each row holds one trajectory (segment id 1, positions from 0)
padded with segment 0. Per-token `weight` carries the loss aggregation, normalised per minibatch:
`token_mean` gives every loss token of the minibatch the same weight, `sequence_mean` every
trajectory.

Trajectories longer than the largest bucket are truncated (status truncated, `batch/truncated`) or,
with `shapes.overlong: reject`, left out of the loss (`batch/rejected`); trajectories with status
error stay out of the loss and out of their group's baseline.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from headrace.config import LearnerConfig, ShapesConfig
from headrace.learner.advantages import group_advantages
from headrace.metrics.core import Metrics
from headrace.shapes import bucket_for
from headrace.types import STATUS_ERROR, Group

FIELDS = ("tokens", "positions", "segment_ids", "loss_mask", "behaviour_logprobs", "advantages",
          "weight")


@dataclasses.dataclass
class Batch:
    arrays: dict[str, np.ndarray]  # each [M, R, L]
    real_tokens: int
    loss_tokens: int
    lags_gen: list[int] = dataclasses.field(default_factory=list)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.arrays["tokens"].shape


class Batcher:
    def __init__(self, learner: LearnerConfig, shapes: ShapesConfig, metrics: Metrics):
        self.learner = learner
        self.shapes = shapes
        self.metrics = metrics

    def build(self, groups: list[Group]) -> Batch:
        cfg = self.learner
        trajectories, advantages, use = [], [], []
        for group in groups:
            valid = np.array([t.status != STATUS_ERROR for t in group.trajectories])
            rewards = np.array([t.reward for t in group.trajectories])
            adv = group_advantages(rewards, valid, cfg.advantage, cfg.advantage_std_norm)
            trajectories += group.trajectories
            advantages += list(adv)
            use += list(valid)
        longest = self.shapes.buckets[-1]
        lengths = np.array([len(t) for t in trajectories])
        overlong = lengths > longest
        if overlong.any():
            if self.shapes.overlong == "reject":
                self.metrics.count("batch/rejected", int(overlong.sum()))
                use = [u and not o for u, o in zip(use, overlong)]
            else:
                self.metrics.count("batch/truncated", int(overlong.sum()))
            lengths = np.minimum(lengths, longest)
        m = cfg.minibatches
        rows = -(-len(trajectories) // m)
        width = bucket_for(int(lengths.max()), self.shapes.buckets)
        arrays = {name: np.zeros((m * rows, width), np.float32 if name in (
            "loss_mask", "behaviour_logprobs", "advantages", "weight") else np.int32)
            for name in FIELDS}
        for i, (t, n) in enumerate(zip(trajectories, lengths)):
            arrays["tokens"][i, :n] = t.tokens[:n]
            arrays["positions"][i, :n] = np.arange(n)
            arrays["segment_ids"][i, :n] = 1
            if use[i]:
                arrays["loss_mask"][i, :n] = t.loss_mask[:n]
            arrays["behaviour_logprobs"][i, :n] = t.behaviour_logprobs[:n]
            arrays["advantages"][i, :n] = advantages[i]
        arrays = {k: v.reshape(m, rows, width) for k, v in arrays.items()}
        arrays["weight"] = self._weights(arrays["loss_mask"])
        real = int(lengths.sum())
        self.metrics.gauge("batch/packing_efficiency", real / (m * rows * width))
        return Batch(arrays, real, int(arrays["loss_mask"].sum()))

    def _weights(self, mask_mrl: np.ndarray) -> np.ndarray:
        """Per-token loss weights summing to 1 over each minibatch's loss tokens."""
        if self.learner.loss_agg == "token_mean":
            per_minibatch = mask_mrl.sum(axis=(1, 2), keepdims=True)
            return mask_mrl / np.maximum(per_minibatch, 1)
        per_row = mask_mrl.sum(axis=2, keepdims=True)
        rows_with_loss = (per_row > 0).sum(axis=1, keepdims=True)
        return mask_mrl / np.maximum(per_row, 1) / np.maximum(rows_with_loss, 1)
