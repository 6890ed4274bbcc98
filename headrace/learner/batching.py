"""From groups to fixed-shape microbatches (host side, NumPy).

One learner step consumes its groups as `learner.minibatches` optimizer updates: the groups are
split in order into that many minibatches (fewer when there are fewer groups), and each minibatch
is packed (`packing.py`) into one or more microbatches of shapes from the policy
(`headrace.shapes.ShapePolicy`). The train step sums the microbatches' gradients and applies one
update per minibatch. The packing plan is a pure function of the trajectory lengths, so with
several learner hosts process 0 can decide it and broadcast it.

Per token each microbatch carries `tokens`, `positions` (restarting at 0 per segment),
`segment_ids` (1, 2, ... per row; 0 is padding), `loss_mask`, `behaviour_logprobs`, `advantages`
(the trajectory's), `policy_version` and `weight`. `weight` is the loss aggregation, normalised over
the whole minibatch (all its microbatches), so summed microbatch gradients equal the minibatch
gradient exactly: `token_mean` gives every loss token of the minibatch the same weight,
`sequence_mean` every trajectory with loss tokens the same total weight, `token_sum` every loss
token 1 / (trajectories x the largest length bucket), a constant: a trajectory weighs its loss
tokens, and neither long nor short ones are favoured per token (Dr. GRPO, Liu et al. 2025).

What is left out of packing (so it costs no slots):
- status `error` trajectories: out of the loss and out of their group's baseline;
- trajectories without a trainable token: the first token of a segment is never trained (nothing
  precedes it in its segment), so a loss mask only on token 0 counts as none;
- with `shapes.overlong: reject`, trajectories longer than the largest bucket (`batch/rejected`);
  they stay in their group's baseline. With `truncate` (default) they are cut to the largest bucket
  and trained as status truncated (`batch/truncated`); the input groups are not modified.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from headrace.config import LearnerConfig, ShapesConfig
from headrace.learner import packing
from headrace.learner.advantages import group_advantages
from headrace.metrics.core import Metrics
from headrace.shapes import ShapePolicy
from headrace.types import STATUS_ERROR, Group, Trajectory

FIELDS = {"tokens": np.int32, "positions": np.int32, "segment_ids": np.int32,
          "loss_mask": np.float32, "behaviour_logprobs": np.float32, "advantages": np.float32,
          "policy_version": np.int32, "weight": np.float32}
TRAIN_FIELDS = ("tokens", "positions", "segment_ids", "behaviour_logprobs", "advantages", "weight")


@dataclasses.dataclass
class Microbatch:
    """Arrays of shape [rows, width] (see FIELDS); `last`: the minibatch's update follows it."""

    arrays: dict[str, Any]
    minibatch: int
    last: bool

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.arrays["tokens"].shape)


@dataclasses.dataclass
class Batch:
    """One learner step: microbatches in order, minibatch by minibatch."""

    microbatches: list[Microbatch]
    updates: int  # minibatches with at least one microbatch (optimizer updates this step)
    real_tokens: int  # tokens placed (after truncation)
    loss_tokens: int  # tokens with weight > 0
    slots: int  # token slots over all microbatches (real + padding)
    trajectories: int  # trajectories placed

    @property
    def packing_efficiency(self) -> float:
        return self.real_tokens / self.slots if self.slots else 1.0

    @property
    def shapes(self) -> set[tuple[int, int]]:
        return {mb.shape for mb in self.microbatches}


@dataclasses.dataclass
class _Columns:
    """A minibatch's trajectories end to end, those with a trainable token, each cut to its
    length: every per-token field concatenated in order, `starts[i]` where the i-th begins."""

    lengths: np.ndarray  # int64[items]
    starts: np.ndarray  # int64[items]
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    mask: np.ndarray  # bool: trainable tokens (the loss mask, a trajectory's first token off)
    advantages: np.ndarray  # float32[items]
    item_loss_tokens: np.ndarray  # int64[items]

    @classmethod
    def of(cls, chosen: list[tuple[Trajectory, int, float]]) -> _Columns:
        """From (trajectory, length, advantage) triples; those left without a trainable token
        are dropped."""
        lengths = np.fromiter((n for _, n, _ in chosen), np.int64, len(chosen))
        starts = np.cumsum(lengths) - lengths

        def joined(name: str, dtype) -> np.ndarray:
            parts = [getattr(t, name)[:n] for t, n, _ in chosen]
            return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

        mask = joined("loss_mask", bool)  # a new array: concatenate copies
        mask[starts] = False  # nothing precedes a segment's first token in its segment
        loss = (np.add.reduceat(mask, starts, dtype=np.int64) if chosen
                else np.zeros(0, np.int64))
        columns = cls(lengths, starts, joined("tokens", np.int32),
                      joined("behaviour_logprobs", np.float32),
                      joined("policy_version", np.int32), mask,
                      np.array([a for _, _, a in chosen], np.float32), loss)
        return columns if loss.all() else columns._only(loss > 0)

    def _only(self, keep: np.ndarray) -> _Columns:
        per_token = np.repeat(keep, self.lengths)
        lengths = self.lengths[keep]
        return _Columns(lengths, np.cumsum(lengths) - lengths, self.tokens[per_token],
                        self.logprobs[per_token], self.versions[per_token], self.mask[per_token],
                        self.advantages[keep], self.item_loss_tokens[keep])

    @property
    def loss_tokens(self) -> int:
        return int(self.item_loss_tokens.sum())


class Batcher:
    """Builds `Batch`es from groups. Not thread-safe; one builder thread at a time.

    `layout` picks the packing (`packing.LAYOUTS`): `bucketed` for training; the baselines exist
    for the packing benchmark, which must drive this same code path.
    """

    def __init__(self, learner: LearnerConfig, shapes: ShapesConfig, metrics: Metrics,
                 layout: str = "bucketed", row_multiple: int = 1, peers=None):
        """`peers`: the other learner processes of a multi-host learner
        (`parallel.multihost.Peers`): weights are then normalised over the global minibatch and
        microbatch shapes agreed with them; None: this process alone."""
        if layout not in packing.LAYOUTS:
            raise ValueError(f"layout {layout!r}: one of {', '.join(packing.LAYOUTS)}")
        self.learner = learner
        self.shapes = shapes
        self.metrics = metrics
        self.layout = layout
        self.policy = ShapePolicy.from_config(shapes, learner, row_multiple)
        self.peers = peers

    def build(self, groups: Sequence[Group]) -> Batch:
        """Packs the step's groups into microbatches (counts batch/truncated and batch/rejected;
        gauges batch/packing_efficiency). Never raises for lengths: over-long ones are handled."""
        splits = np.array_split(np.arange(len(groups)), min(self.learner.minibatches,
                                                            max(len(groups), 1)))
        minibatches = [_Columns.of(self._chosen([groups[i] for i in split]))
                       for split in splits]
        plans = packing.plan_step([mb.lengths.tolist() for mb in minibatches], self.policy,
                                  self.layout)
        counts = np.array([[mb.loss_tokens, len(mb.lengths)] for mb in minibatches],
                          np.int64).reshape(-1, 2)
        if self.peers is not None:  # one global minibatch over every learner process
            counts = self.peers.total(counts)
            plans = _pad_to(plans, self.peers.agree([[p.shape for p in mb] for mb in plans]))
        out: list[Microbatch] = []
        updates = real = loss = slots = placed = 0
        for index, (columns, mb_plans) in enumerate(zip(minibatches, plans)):
            weight = self._weights(columns, *counts[index])
            for k, plan in enumerate(mb_plans):
                out.append(Microbatch(_fill(plan, columns, weight), index,
                                      last=k == len(mb_plans) - 1))
                slots += plan.slots
            updates += bool(mb_plans)
            real += columns.tokens.size
            loss += columns.loss_tokens
            placed += len(columns.lengths)
        batch = Batch(out, updates, real, loss, slots, placed)
        self.metrics.gauge("batch/packing_efficiency", batch.packing_efficiency)
        self.metrics.gauge("batch/microbatches", len(out))
        return batch

    def _chosen(self, groups: Sequence[Group]) -> list[tuple[Trajectory, int, float]]:
        """(trajectory, length to train, advantage) of each trajectory packing may place."""
        cfg = self.learner
        longest = self.policy.longest
        chosen = []
        truncated = rejected = 0
        for group in groups:
            valid = np.array([t.status != STATUS_ERROR for t in group.trajectories])
            rewards = np.array([t.reward for t in group.trajectories])
            adv = group_advantages(rewards, valid, cfg.advantage, cfg.advantage_std_norm)
            for t, ok, a in zip(group.trajectories, valid.tolist(), adv.tolist()):
                n = len(t)
                if not ok or n == 0:
                    continue
                if n > longest:
                    if self.shapes.overlong == "reject":
                        rejected += 1
                        continue
                    truncated += 1
                    n = longest
                chosen.append((t, n, a))
        if truncated:
            self.metrics.count("batch/truncated", truncated)
        if rejected:
            self.metrics.count("batch/rejected", rejected)
        return chosen

    def _weights(self, columns: _Columns, loss_tokens: int, trajectories: int) -> np.ndarray:
        """Per-token weights (the counts are the minibatch's: over every learner process when
        there are several): summing to 1 over its loss tokens, but for `token_sum`'s constant."""
        if self.learner.loss_agg == "token_mean":
            return columns.mask / np.float32(max(int(loss_tokens), 1))
        if self.learner.loss_agg == "token_sum":
            return columns.mask / np.float32(max(int(trajectories), 1) * self.policy.longest)
        # sequence_mean: every trajectory with loss tokens weighs 1 / (their count)
        per_item = (columns.item_loss_tokens * max(int(trajectories), 1)).astype(np.float32)
        return columns.mask / np.repeat(per_item, columns.lengths)


def _fill(plan: packing.MicrobatchPlan, columns: _Columns,
          weight: np.ndarray) -> dict[str, np.ndarray]:
    """The microbatch's arrays: every placement's tokens copied at once (index arrays built from
    the plan; no per-trajectory copy)."""
    arrays = {name: np.zeros(plan.shape, dtype) for name, dtype in FIELDS.items()}
    if not plan.placements:
        return arrays
    item, row, offset, length = np.array(
        [(p.item, p.row, p.offset, p.length) for p in plan.placements], np.int64).T
    total = int(length.sum())
    within = np.arange(total) - np.repeat(np.cumsum(length) - length, length)  # its position
    dst = np.repeat(row * plan.width + offset, length) + within
    src = np.repeat(columns.starts[item], length) + within
    # a row's segments are numbered 1, 2, ... in placement order
    order = np.argsort(row, kind="stable")
    first = np.searchsorted(row[order], row[order])  # where each one's row begins, sorted
    segment = np.empty_like(row)
    segment[order] = np.arange(len(row)) - first + 1
    flat = {name: array.reshape(-1) for name, array in arrays.items()}  # views
    flat["tokens"][dst] = columns.tokens[src]
    flat["positions"][dst] = within
    flat["segment_ids"][dst] = np.repeat(segment, length)
    flat["loss_mask"][dst] = columns.mask[src]
    flat["behaviour_logprobs"][dst] = columns.logprobs[src]
    flat["advantages"][dst] = np.repeat(columns.advantages[item], length)
    flat["policy_version"][dst] = columns.versions[src]
    flat["weight"][dst] = weight[src]
    return arrays


def _pad_to(plans: list[list[packing.MicrobatchPlan]],
            agreed: list[list[tuple[int, int]]]) -> list[list[packing.MicrobatchPlan]]:
    """This process's plans laid onto the agreed shapes (`Peers.agree`): widest first, each
    padded to its agreed rows and width, all-padding microbatches where this process has fewer."""
    out = []
    for mine, shapes in zip(plans, agreed):
        mine = sorted(mine, key=lambda p: (p.width, p.rows), reverse=True)
        out.append([packing.MicrobatchPlan(rows, width, mine[j].placements if j < len(mine) else ())
                    for j, (rows, width) in enumerate(shapes)])
    return out
