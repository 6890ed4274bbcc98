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
`sequence_mean` every trajectory with loss tokens the same total weight.

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
class _Item:
    trajectory: Trajectory
    length: int
    advantage: float
    mask: np.ndarray  # bool[length], trainable loss tokens (token 0 excluded)


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
        self._positions = np.arange(self.policy.longest, dtype=np.int32)

    def build(self, groups: Sequence[Group]) -> Batch:
        """Packs the step's groups into microbatches (counts batch/truncated and batch/rejected;
        gauges batch/packing_efficiency). Never raises for lengths: over-long ones are handled."""
        splits = np.array_split(np.arange(len(groups)), min(self.learner.minibatches,
                                                            max(len(groups), 1)))
        minibatches = [self._items([groups[i] for i in split]) for split in splits]
        plans = packing.plan_step([[it.length for it in items] for items in minibatches],
                                  self.policy, self.layout)
        counts = np.array([[sum(int(it.mask.sum()) for it in items), len(items)]
                           for items in minibatches], np.int64).reshape(-1, 2)
        if self.peers is not None:  # one global minibatch over every learner process
            counts = self.peers.total(counts)
            plans = _pad_to(plans, self.peers.agree([[p.shape for p in mb] for mb in plans]))
        out: list[Microbatch] = []
        updates = real = loss = slots = placed = 0
        for index, (items, mb_plans) in enumerate(zip(minibatches, plans)):
            weights = self._weights(items, *counts[index])
            for k, plan in enumerate(mb_plans):
                out.append(Microbatch(self._fill(plan, items, weights), index,
                                      last=k == len(mb_plans) - 1))
                slots += plan.slots
            updates += bool(mb_plans)
            real += sum(it.length for it in items)
            loss += sum(int(it.mask.sum()) for it in items)
            placed += len(items)
        batch = Batch(out, updates, real, loss, slots, placed)
        self.metrics.gauge("batch/packing_efficiency", batch.packing_efficiency)
        self.metrics.gauge("batch/microbatches", len(out))
        return batch

    def _items(self, groups: Sequence[Group]) -> list[_Item]:
        cfg = self.learner
        longest = self.policy.longest
        items = []
        truncated = rejected = 0
        for group in groups:
            valid = np.array([t.status != STATUS_ERROR for t in group.trajectories])
            rewards = np.array([t.reward for t in group.trajectories])
            adv = group_advantages(rewards, valid, cfg.advantage, cfg.advantage_std_norm)
            for t, ok, a in zip(group.trajectories, valid, adv):
                n = len(t)
                if not ok or n == 0:
                    continue
                if n > longest:
                    if self.shapes.overlong == "reject":
                        rejected += 1
                        continue
                    truncated += 1
                    n = longest
                mask = np.asarray(t.loss_mask[:n], bool).copy()
                mask[0] = False
                if mask.any():
                    items.append(_Item(t, n, float(a), mask))
        if truncated:
            self.metrics.count("batch/truncated", truncated)
        if rejected:
            self.metrics.count("batch/rejected", rejected)
        return items

    def _weights(self, items: list[_Item], loss_tokens: int, trajectories: int) -> list[np.ndarray]:
        """Per-trajectory token weights summing to 1 over the minibatch's loss tokens (the counts
        are the minibatch's: over every learner process when there are several)."""
        if self.learner.loss_agg == "token_mean":
            total = max(int(loss_tokens), 1)
            return [it.mask / np.float32(total) for it in items]
        # sequence_mean: every trajectory with loss tokens weighs 1 / (their count)
        return [it.mask / np.float32(it.mask.sum() * max(int(trajectories), 1)) for it in items]

    def _fill(self, plan: packing.MicrobatchPlan, items: list[_Item],
              weights: list[np.ndarray]) -> dict[str, np.ndarray]:
        arrays = {name: np.zeros(plan.shape, dtype) for name, dtype in FIELDS.items()}
        segment = np.zeros(plan.rows, np.int32)
        for p in plan.placements:
            item, t = items[p.item], items[p.item].trajectory
            row, cols = p.row, slice(p.offset, p.offset + p.length)
            segment[row] += 1
            arrays["tokens"][row, cols] = t.tokens[:p.length]
            arrays["positions"][row, cols] = self._positions[:p.length]
            arrays["segment_ids"][row, cols] = segment[row]
            arrays["loss_mask"][row, cols] = item.mask
            arrays["behaviour_logprobs"][row, cols] = t.behaviour_logprobs[:p.length]
            arrays["advantages"][row, cols] = item.advantage
            arrays["policy_version"][row, cols] = t.policy_version[:p.length]
            arrays["weight"][row, cols] = weights[p.item]
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
