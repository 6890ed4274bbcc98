"""Where each trajectory of a minibatch goes: microbatch plans computed from lengths alone.

A plan is a pure, deterministic function of the minibatch's trajectory lengths and the shape policy
(`headrace.shapes.ShapePolicy`), so with several learner hosts process 0 can decide each step's
microbatch shapes and broadcast the plan. Three layouts share one output type:

- `bucketed` (training): best-fit decreasing. Trajectories are placed longest first, each into the
  open row whose free space fits it most tightly; leftover space in a row is filled with shorter
  trajectories (from lower buckets). When nothing fits, a microbatch of the trajectory's own bucket
  is opened with all its rows, so later (shorter) trajectories fill those rows before another
  microbatch opens. With fixed rows every microbatch has a policy shape (at most one compiled
  program per bucket) and about `token_budget` slots, so padding is at most the unfilled rest of
  the last microbatch plus row fragmentation. With `shapes.tail_splits` a microbatch then takes
  the fewest of its bucket's row counts (`ShapePolicy.tail_rows`) that hold the rows it uses, so
  a partly filled last microbatch costs a fraction of the budget (rows fill in order: the used
  rows are a prefix, no placement moves).
- `pad_to_max` (baseline): one trajectory per row, every row the largest bucket.
- `per_length` (baseline): one trajectory per row, in arrival order, rows padded to the
  minibatch's own longest length (not a bucket); the last microbatch has just the rows it needs,
  so shapes follow the data and recompile.

Placements never overlap, never cross a row's end, and cover every trajectory exactly once
(tests check these against a brute-force occupancy grid).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence

from headrace.shapes import ShapePolicy


@dataclasses.dataclass(frozen=True)
class Placement:
    """Trajectory `item` (its index in the packed list) at `row`, columns [offset, offset+length)."""

    item: int
    row: int
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class MicrobatchPlan:
    """One microbatch: `rows` x `width` token slots and the trajectories placed in them."""

    rows: int
    width: int
    placements: tuple[Placement, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.width

    @property
    def used(self) -> int:
        return sum(p.length for p in self.placements)

    @property
    def slots(self) -> int:
        return self.rows * self.width


Layout = Callable[[Sequence[int], ShapePolicy], list[MicrobatchPlan]]


def _check(lengths: Sequence[int], policy: ShapePolicy) -> None:
    for i, n in enumerate(lengths):
        if not 1 <= n <= policy.longest:
            raise ValueError(f"trajectory {i} has length {n}: packing needs 1..{policy.longest} "
                             "(truncate or reject longer ones first, skip empty ones)")


def _decreasing(lengths: Sequence[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def bucketed(lengths: Sequence[int], policy: ShapePolicy) -> list[MicrobatchPlan]:
    """Best-fit decreasing packing into policy shapes (see the module docstring).

    Raises:
      ValueError: a length is outside 1..policy.longest.
    """
    _check(lengths, policy)
    if not lengths:
        return []
    if not policy.fixed_rows:
        return [_one_microbatch(lengths, policy)]
    widths: list[int] = []  # per open microbatch
    rows: list[int] = []
    placed: list[list[Placement]] = []
    free: list[tuple[int, int, int]] = []  # sorted (free slots, microbatch, row)
    for item in _decreasing(lengths):
        n = lengths[item]
        k = bisect.bisect_left(free, (n, -1, -1))
        if k == len(free):  # nothing fits: open a microbatch of this trajectory's bucket
            bucket = policy.bucket_for(n)
            mb = len(widths)
            widths.append(bucket)
            rows.append(policy.rows(bucket))
            placed.append([])
            for r in range(rows[mb]):
                bisect.insort(free, (bucket, mb, r))
            k = bisect.bisect_left(free, (n, -1, -1))
        room, mb, row = free.pop(k)
        placed[mb].append(Placement(item, row, widths[mb] - room, n))
        if room > n:
            bisect.insort(free, (room - n, mb, row))
    return [_trimmed(w, p, policy) for w, p in zip(widths, placed)]


def _trimmed(width: int, placements: list[Placement], policy: ShapePolicy) -> MicrobatchPlan:
    """A microbatch of `width` with the fewest of its bucket's row counts that hold the rows
    `placements` use (the full count unless `policy.tail_splits`), rows renumbered in order."""
    used = sorted({p.row for p in placements})
    rows = policy.rows_holding(width, len(used))
    if len(used) == rows or used[-1] < rows:  # nothing to renumber
        return MicrobatchPlan(rows, width, tuple(placements))
    new = {row: k for k, row in enumerate(used)}
    return MicrobatchPlan(rows, width, tuple(dataclasses.replace(p, row=new[p.row])
                                             for p in placements))


def _one_microbatch(lengths: Sequence[int], policy: ShapePolicy) -> MicrobatchPlan:
    """No fixed rows: every trajectory in rows of the longest one's bucket, best fit decreasing."""
    width = policy.bucket_for(max(lengths))
    free: list[tuple[int, int]] = []  # sorted (free slots, row)
    placed: list[Placement] = []
    used_rows = 0
    for item in _decreasing(lengths):
        n = lengths[item]
        k = bisect.bisect_left(free, (n, -1))
        if k == len(free):
            free.insert(k, (width, used_rows))
            used_rows += 1
        room, row = free.pop(k)
        placed.append(Placement(item, row, width - room, n))
        if room > n:
            bisect.insort(free, (room - n, row))
    return MicrobatchPlan(policy.rows_for(used_rows), width, tuple(placed))


def _one_per_row(items: Sequence[int], lengths: Sequence[int], rows: int,
                 width: int) -> list[MicrobatchPlan]:
    plans = []
    for start in range(0, len(items), rows):
        chunk = items[start:start + rows]
        placements = tuple(Placement(i, r, 0, lengths[i]) for r, i in enumerate(chunk))
        plans.append(MicrobatchPlan(rows, width, placements))
    return plans


def pad_to_max(lengths: Sequence[int], policy: ShapePolicy) -> list[MicrobatchPlan]:
    """Baseline: one trajectory per row, every row `policy.longest` slots, arrival order."""
    _check(lengths, policy)
    if not lengths:
        return []
    width = policy.longest
    rows = policy.rows(width) if policy.fixed_rows else policy.rows_for(len(lengths))
    return _one_per_row(range(len(lengths)), lengths, rows, width)


def per_length(lengths: Sequence[int], policy: ShapePolicy) -> list[MicrobatchPlan]:
    """Baseline: one trajectory per row padded to the minibatch's longest length, arrival order.

    Rows per microbatch follow the budget at that exact width (`token_budget // width`, or
    `rows_per_bucket`); the last microbatch keeps only the rows it needs. Shapes vary with the data.
    """
    _check(lengths, policy)
    if not lengths:
        return []
    width = max(lengths)
    if policy.rows_per_bucket:
        rows = policy.rows_per_bucket
    elif policy.token_budget:
        rows = max(1, policy.token_budget // width)
    else:
        rows = len(lengths)
    plans = _one_per_row(range(len(lengths)), lengths, rows, width)
    last = plans[-1]
    plans[-1] = MicrobatchPlan(len(last.placements), width, last.placements)
    return plans


LAYOUTS: dict[str, Layout] = {"bucketed": bucketed, "pad_to_max": pad_to_max,
                              "per_length": per_length}


def plan_step(lengths_by_minibatch: Sequence[Sequence[int]], policy: ShapePolicy,
              layout: str = "bucketed") -> list[list[MicrobatchPlan]]:
    """Microbatch plans for each minibatch of one learner step (a pure function of the lengths).

    Raises:
      ValueError: unknown layout, or a length outside 1..policy.longest.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: one of {', '.join(LAYOUTS)}")
    return [LAYOUTS[layout](list(lengths), policy) for lengths in lengths_by_minibatch]


def efficiency(plans: Sequence[MicrobatchPlan]) -> float:
    """Real tokens / token slots over `plans` (1.0 when there are none)."""
    slots = sum(p.slots for p in plans)
    return sum(p.used for p in plans) / slots if slots else 1.0
