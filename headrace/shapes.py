"""The shape policy shared by the sampler and the batcher (JAX-free).

Every array the accelerator sees has a shape drawn from a finite set, so XLA compiles a bounded
number of programs:

- sequence lengths come from the bucket ladder (`shapes.buckets`, default powers of two 32..4096);
- the sampler's batch rows come from `batch_ladder` (a coarse ladder of row counts);
- the learner's microbatches have shape `ShapePolicy.shape(bucket)`: with a token budget,
  `rows = token_budget // bucket` (at least 1), so every microbatch holds about the same number of
  token slots and memory stays flat across buckets; `shapes.rows_per_bucket` fixes the rows
  instead. Without either, a minibatch is one microbatch whose rows are rounded up on a
  coarse ladder (`rows_for_count`);
- with `shapes.tail_splits: k` a bucket also has microbatches of 1/2, 1/4, ... 1/2^k of its rows,
  for a minibatch's partly filled microbatches (its tail): finer granularity where short steps
  would leave most of a last microbatch empty, at up to k more shapes per bucket used;
- `choose_ladder` picks a short ladder from observed lengths, so that buckets x tail shapes stay
  within a compile bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from headrace.config import LearnerConfig, ShapesConfig


class TooLong(ValueError):
    """A length exceeds the largest bucket."""


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `length`.

    Raises:
      TooLong: `length` exceeds the largest bucket.
    """
    for bucket in buckets:
        if length <= bucket:
            return bucket
    raise TooLong(f"length {length} exceeds the largest bucket {buckets[-1]}")


def batch_ladder(max_batch: int, smallest: int = 8, factor: int = 4) -> tuple[int, ...]:
    """Row counts a batched call may use: `max_batch`, max_batch / factor, ... down to `smallest`.

    A coarse ladder keeps compilations few; padding a small batch up costs little in absolute time.
    """
    sizes = [max_batch]
    while sizes[-1] // factor >= smallest:
        sizes.append(sizes[-1] // factor)
    if sizes[-1] > smallest:
        sizes.append(min(smallest, max_batch))
    return tuple(sorted(set(sizes)))


def split_rows(count: int, sizes: Sequence[int], max_waste: float = 0.25) -> list[int]:
    """Row counts from `sizes` (ascending) whose calls serve `count` rows with little padding.

    Padding `count` up to the next size of a coarse ladder can nearly quadruple the work (300 rows
    on {16, 64, 256, 1024} run as 1024). Instead, while the next size up would add more padding
    rows than `max_waste` of `count`, a call of the largest size that fits is taken and the rest
    served after it (300 -> 256 + 64), but only when that at least halves the rows computed;
    otherwise one padded call (389 -> 512, not 128 x 3 + 8). Every call keeps a shape from
    `sizes`, so nothing new compiles.

    Raises:
      ValueError: `count` exceeds the largest size.
    """
    if count > sizes[-1]:
        raise ValueError(f"{count} rows exceed the largest batch size {sizes[-1]}")
    calls: list[int] = []
    left = count
    while left > 0:
        up = next(size for size in sizes if size >= left)
        fits = [size for size in sizes if size <= left]
        if up - left <= max_waste * count or not fits:
            calls.append(up)
            break
        calls.append(fits[-1])
        left -= fits[-1]
    whole = next(size for size in sizes if size >= count)
    # Several calls cost more per row than one (dispatch; smaller matmuls): split only where it
    # at least halves the rows computed (the gaps of a 4x ladder), else pad up as one call.
    return calls if 2 * sum(calls) <= whole else [whole]


def rows_for_count(count: int) -> int:
    """The smallest row count >= `count` on a ladder of four steps per octave: 1..8, then
    m * 2^k with m in 5..8 (10, 12, 14, 16, 20, 24, ...). The ladder used when no row count is
    fixed: at most 25 % padding rows (about 10 % on average) and 4 shapes per octave."""
    count = max(int(count), 1)
    if count <= 8:
        return count
    k = (count - 1).bit_length() - 3
    return -(-count // (1 << k)) << k


@dataclasses.dataclass(frozen=True)
class ShapePolicy:
    """Which (rows, bucket) shapes a learner microbatch may have.

    With `token_budget` or `rows_per_bucket` set ("fixed rows") there is exactly one shape per
    bucket, so a learner compiles at most `len(buckets)` train-step programs. Without them a
    minibatch is one microbatch of `rows_for_count(rows needed)` rows: at most
    `len(buckets) * 4 * (log2(max rows) + 1)` shapes, in practice a few per bucket since a step's
    trajectory count hardly varies.

    Raises:
      ValueError: buckets empty, not strictly increasing or below 1; a negative budget or row count.
    """

    buckets: tuple[int, ...]
    token_budget: int = 0  # token slots per microbatch (0: no budget)
    rows_per_bucket: int = 0  # rows of every microbatch, whatever its bucket (0: from the budget)
    row_multiple: int = 1  # every row count is rounded up to a multiple (a mesh's data x fsdp)
    tail_splits: int = 0  # a bucket's rows may also be halved this many times (fixed rows only)

    def __post_init__(self):
        buckets = tuple(int(b) for b in self.buckets)
        if not buckets or buckets[0] < 1 or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets {self.buckets}: need a non-empty, strictly increasing "
                             "list of lengths >= 1")
        if self.row_multiple < 1:
            raise ValueError(f"row_multiple={self.row_multiple}: must be >= 1")
        if self.token_budget < 0 or self.rows_per_bucket < 0 or self.tail_splits < 0:
            raise ValueError(f"token_budget={self.token_budget}, rows_per_bucket="
                             f"{self.rows_per_bucket}, tail_splits={self.tail_splits}: "
                             "must be >= 0")
        object.__setattr__(self, "buckets", buckets)

    @classmethod
    def from_config(cls, shapes: ShapesConfig, learner: LearnerConfig,
                    row_multiple: int = 1) -> ShapePolicy:
        return cls(tuple(shapes.buckets), learner.token_budget, shapes.rows_per_bucket,
                   row_multiple, shapes.tail_splits)

    def _round(self, rows: int) -> int:
        return -(-rows // self.row_multiple) * self.row_multiple

    def rows_for(self, count: int) -> int:
        """Rows of a microbatch holding `count` rows of data, when rows are not fixed: the
        `rows_for_count` ladder, rounded up to `row_multiple`."""
        return self._round(rows_for_count(count))

    @property
    def longest(self) -> int:
        return self.buckets[-1]

    @property
    def fixed_rows(self) -> bool:
        """True when each bucket has one row count (a token budget or `rows_per_bucket`)."""
        return bool(self.rows_per_bucket or self.token_budget)

    def bucket_for(self, length: int) -> int:
        """The smallest bucket holding `length`. Raises `TooLong` past the largest."""
        return bucket_for(length, self.buckets)

    def rows(self, bucket: int) -> int:
        """Rows of a microbatch of `bucket`: `rows_per_bucket`, else `token_budget // bucket`
        (at least 1, so a bucket longer than the budget still gets one row).

        Raises:
          ValueError: the policy has no fixed rows, or `bucket` is not on the ladder.
        """
        if bucket not in self.buckets:
            raise ValueError(f"{bucket} is not a bucket of {self.buckets}")
        if self.rows_per_bucket:
            return self._round(self.rows_per_bucket)
        if self.token_budget:
            return self._round(max(1, self.token_budget // bucket))
        raise ValueError("no fixed rows: set learner.token_budget or shapes.rows_per_bucket")

    def shape(self, bucket: int) -> tuple[int, int]:
        """(rows, bucket) of a full microbatch of `bucket` (fixed rows only)."""
        return self.rows(bucket), bucket

    def tail_rows(self, bucket: int) -> tuple[int, ...]:
        """Row counts a microbatch of `bucket` may have, ascending: `rows(bucket)` halved up to
        `tail_splits` times (each rounded up to `row_multiple`, at least one row)."""
        full = self.rows(bucket)
        return tuple(sorted({self._round(max(full >> j, 1)) for j in range(self.tail_splits + 1)}))

    def rows_holding(self, bucket: int, used: int) -> int:
        """The fewest rows of `bucket`'s tail rows that hold `used` rows of data."""
        return next(r for r in self.tail_rows(bucket) if r >= used)

    def shapes(self) -> tuple[tuple[int, int], ...]:
        """Every microbatch shape of a fixed-rows policy (tail shapes included), smallest bucket
        first: a learner compiles at most this many train-step programs.

        Raises:
          ValueError: the policy has no fixed rows (its row counts follow the data).
        """
        return tuple((r, b) for b in self.buckets for r in self.tail_rows(b))


def choose_ladder(lengths: Sequence[int], count: int, smallest: int = 32,
                  largest: int = 4096) -> tuple[int, ...]:
    """At most `count` buckets, powers of two in [smallest, largest], chosen for `lengths`.

    The largest bucket is the one holding the longest length (capped at `largest`: longer ones
    are truncated or rejected). The others minimise the attention work of packed rows, about
    sum(length x row width) over the lengths with each placed in the smallest chosen bucket
    that holds it (exact dynamic programme over the candidate powers of two). Use it offline on
    a sample of a task's episode lengths and put the result in `shapes.buckets`; the ladder
    must not change during a run (each new bucket compiles).

    Raises:
      ValueError: no lengths, count < 1, or smallest > largest.
    """
    lengths = np.minimum(np.asarray(lengths, np.int64), largest)
    if lengths.size == 0 or count < 1 or smallest > largest or lengths.min() < 1:
        raise ValueError(f"choose_ladder: need lengths >= 1 and count >= 1 (got {lengths.size} "
                         f"lengths, count {count}, range {smallest}..{largest})")
    candidates = [smallest]
    while candidates[-1] < largest:
        candidates.append(min(candidates[-1] * 2, largest))
    top = next(c for c in candidates if c >= lengths.max())
    candidates = candidates[:candidates.index(top) + 1]
    # mass[i]: tokens of lengths in (candidates[i-1], candidates[i]]
    edges = np.searchsorted(candidates, lengths)
    mass = np.bincount(edges, weights=lengths, minlength=len(candidates))
    tokens_upto = np.concatenate([[0.0], np.cumsum(mass)])
    n = len(candidates)
    # best[k][i]: least cost of serving lengths <= candidates[i] with k buckets, the top one i
    inf = float("inf")
    best = [[inf] * n for _ in range(count + 1)]
    back = [[-1] * n for _ in range(count + 1)]
    for i in range(n):
        best[1][i] = tokens_upto[i + 1] * candidates[i]
    for k in range(2, count + 1):
        for i in range(n):
            for j in range(i):
                cost = best[k - 1][j] + (tokens_upto[i + 1] - tokens_upto[j + 1]) * candidates[i]
                if cost < best[k][i]:
                    best[k][i], back[k][i] = cost, j
    k = min(range(1, count + 1), key=lambda k: (best[k][n - 1], k))
    ladder, i = [], n - 1
    while i >= 0 and k >= 1:
        ladder.append(candidates[i])
        i, k = back[k][i], k - 1
    return tuple(sorted(ladder))
