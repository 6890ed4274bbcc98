"""The sampler's compile scheduler: which compiled program serves each call, and when to compile.

A program is identified by a `ProgramKey` (decoding mode, kept-cache span, rows, width). Without
background compiles a missing program compiles in line, in the call that needs it. With them (an
actor's sampler) a missing program compiles on a background thread while the call's rows ride in
programs already compiled (a wider length bucket, other row counts: a wider left padding, or a
larger span over masked slots, computes the same tokens); only a call that no compiled program
can serve waits (`inline_compiles`: the first calls). A compile takes seconds on a CPU and every
episode of the actor waits on the call, so compiling in line mid-run stalls the whole pool at once
(and synchronises its episodes into waves).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from headrace.shapes import split_rows

log = logging.getLogger(__name__)


class ProgramKey(NamedTuple):
    greedy: bool  # argmax decoding (else sampled)
    span: int | None  # kept-cache slots attended to; None: no kept caches
    rows: int  # a batch-ladder size
    width: int  # the new tokens' width
    top: int = 0  # alternatives returned per token (0: none; a variant of its own)


class Programs:
    """Compiled programs by key, compiled by `compile(params, key)` (the sampler's: it lowers its
    jitted function on example arguments). Used from the sampler's calling thread; the compiler
    thread only adds programs."""

    def __init__(self, compile: Callable[[object, ProgramKey], object],
                 batch_sizes: Sequence[int], background: bool = False):
        self._lower = compile
        self.batch_sizes = tuple(batch_sizes)
        self.compiled: dict[ProgramKey, object] = {}
        self._compiler = (concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="sampler-compile") if background else None)
        self.compiling: dict[ProgramKey, concurrent.futures.Future] = {}
        self.compiles = 0  # programs compiled
        self.inline_compiles = 0  # of them, those a call waited for

    def __getitem__(self, key: ProgramKey):
        return self.compiled[key]

    def compile(self, params, key: ProgramKey) -> None:
        self.compiled[key] = self._lower(params, key)
        self.compiles += 1

    def plan(self, params, count: int, span: int | None, width: int,
             greedy: bool, top: int = 0) -> list[ProgramKey]:
        """The programs of the calls that serve `count` rows of shape (span, width): those
        `split_rows` picks, or (a missing one compiling in the background) stand-ins."""
        plan = []
        for rows in split_rows(count, self.batch_sizes):
            key = ProgramKey(greedy, span, rows, width, top)
            if key in self.compiled:
                plan.append(key)
                continue
            if self._compiler is None:
                self.inline_compiles += 1
                self.compile(params, key)
                plan.append(key)
                continue
            future = self.compiling.get(key)
            if future is None:
                future = self.compiling[key] = self._compiler.submit(self._compile_behind,
                                                                     params, key)
            stand_in = self._stand_in(key)
            if stand_in is None:
                self.inline_compiles += 1
                future.result()  # nothing compiled holds these rows: wait for the compiler
                plan.append(key)
            else:
                plan.extend(stand_in)
        return plan

    def _compile_behind(self, params, key: ProgramKey) -> None:
        start = time.perf_counter()
        try:
            if key in self.compiled:  # compiled while this one was queued
                return
            self.compile(params, key)
            log.info("sampler program %s compiled in the background in %.1f s", tuple(key),
                     time.perf_counter() - start)
        finally:
            self.compiling.pop(key, None)

    def _stand_in(self, want: ProgramKey) -> list[ProgramKey] | None:
        """Calls of compiled programs that hold `want.rows` rows of (span, width), or None."""
        fits = [(k.span, k.width) for k in list(self.compiled)
                if k.greedy == want.greedy and k.top == want.top and k.width >= want.width
                and (k.span is None) == (want.span is None)
                and (want.span is None or k.span >= want.span)]
        if not fits:
            return None
        span, width = min(fits, key=lambda sw: (sw[1], sw[0] or 0))
        sizes = sorted(k.rows for k in list(self.compiled)
                       if (k.greedy, k.span, k.width, k.top) == (want.greedy, span, width,
                                                                  want.top))
        calls, left = [], want.rows
        while left > 0:  # the smallest size that holds the rest, else the largest there is
            rows = next((r for r in sizes if r >= left), sizes[-1])
            calls.append(ProgramKey(want.greedy, span, rows, width, want.top))
            left -= rows
        return calls

    def close(self) -> None:
        """Drops queued background compiles (one already running finishes)."""
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
