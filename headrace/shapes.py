"""The shape policy shared by the sampler and the batcher (JAX-free).

Every array the accelerator sees has a shape drawn from a finite set: sequence lengths come from the
bucket ladder (`shapes.buckets`), batch rows from a ladder of powers of two, so XLA compiles a
bounded number of programs.
"""

from __future__ import annotations

from collections.abc import Sequence


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
