"""Batching many episodes' policy calls into one sampler call, and keeping weights fresh.

Episodes are coroutines on one asyncio loop; each `await policy.act(context)` parks a request. The
server task runs one batched `Sampler.generate` (in a worker thread, so environment coroutines keep
running) as soon as every live episode that is not away (stepping its environment, writing to the
buffer) is waiting, when `max_batch` requests are parked, or `wait_s` after the first request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time

import numpy as np

from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.model.sampler import PromptTooLong, Sampler
from headrace.weights.base import VersionGone, WeightStore

log = logging.getLogger(__name__)


class WeightSync:
    """Moves the sampler to the newest (or, for experiments, `forced_lag`-old) published weights."""

    def __init__(self, store: WeightStore, sampler: Sampler, metrics: Metrics, forced_lag: int = 0,
                 poll_s: float = 0.02):
        self.store = store
        self.sampler = sampler
        self.metrics = metrics
        self.forced_lag = forced_lag
        self.poll_s = poll_s
        self._next_poll = 0.0

    def refresh(self, force: bool = False) -> bool:
        """Loads newer weights if there are any; returns whether the sampler changed."""
        now = time.monotonic()
        if not force and now < self._next_poll:
            return False
        self._next_poll = now + self.poll_s
        latest = self.store.latest_version()
        target = max(latest - self.forced_lag, 0) if latest >= 0 else -1
        if target <= self.sampler.version:
            return False
        start = time.perf_counter()
        try:
            flat = self.store.load(target)
        except VersionGone:
            flat, target = self.store.load(latest), latest
        self.sampler.set_params(params_lib.from_host(flat), target)
        self.metrics.observe("weights/pickup_s", time.perf_counter() - start)
        self.store.note_pickup(target, time.time())  # closes the loop for traces
        return True


class BatchedPolicy:
    """Coroutine-facing front of a `Sampler`; one instance per event loop."""

    def __init__(self, sampler: Sampler, metrics: Metrics, *, max_batch: int, wait_s: float,
                 sync: WeightSync | None = None, greedy: bool = False):
        self.sampler = sampler
        self.metrics = metrics
        self.max_batch = max_batch
        self.wait_s = wait_s
        self.sync = sync
        self.greedy = greedy
        self.live = 0
        self.away = 0
        self._free_slots = list(range(sampler.episodes))[::-1]  # the sampler's kept caches
        self._requests: list[tuple[np.ndarray, int | None, asyncio.Future,
                                   tuple[list, float] | None]] = []
        self._wake = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sampler")

    @contextlib.contextmanager
    def episode(self):
        """Registers a live episode for the whole of its run; yields the sampler slot that keeps
        its cache between turns (None when the sampler keeps none, or all are taken)."""
        self.live += 1
        slot = self._free_slots.pop() if self._free_slots else None
        try:
            yield slot
        finally:
            self.live -= 1
            if slot is not None:
                self._free_slots.append(slot)
            self._wake.set()

    @contextlib.contextmanager
    def stepping_away(self):
        """Marks the episode as busy elsewhere (env step, buffer put): the batch need not wait."""
        self.away += 1
        self._wake.set()
        try:
            yield
        finally:
            self.away -= 1

    async def act(self, context: np.ndarray, trace: list | None = None,
                  slot: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
        """Generates one turn for `context`: (tokens, behaviour log-probs, weights version).

        `slot` is the one `episode()` gave: the sampler continues from what it kept there.

        With a `trace` list, appends `(requested, started, finished, rows)` of the call that
        served this turn (unix times; rows: episodes in that call).

        Raises:
          PromptTooLong: the context cannot fit the largest length bucket.
        """
        if len(context) > self.sampler.max_context():
            raise PromptTooLong(f"context of {len(context)} tokens exceeds "
                                f"{self.sampler.max_context()}")
        future = asyncio.get_running_loop().create_future()
        self._requests.append((context, slot, future,
                               trace if trace is None else (trace, time.time())))
        self._wake.set()
        return await future

    def _ready(self) -> bool:
        return len(self._requests) >= min(self.max_batch, max(self.live - self.away, 1))

    async def serve(self) -> None:
        """Runs batched calls until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._requests:
                continue
            if not self._ready():  # more may come: wait until ready or a timer ends the wait
                expired: list[bool] = []  # (a timer, not wait_for: no task per wait)
                timer = loop.call_later(self.wait_s, self._expire, expired)
                while not (expired or self._ready()):
                    await self._wake.wait()
                    self._wake.clear()
                timer.cancel()
            batch, self._requests = self._requests[:self.max_batch], self._requests[self.max_batch:]
            if self._requests:
                self._wake.set()
            await self._run(loop, batch)

    def _expire(self, expired: list[bool]) -> None:
        expired.append(True)
        self._wake.set()

    def _call(self, batch) -> tuple:
        """The sampler call (on the sampler's thread): newer weights first, if any."""
        if self.sync is not None:
            self.sync.refresh()
        slots = [slot for _, slot, _, _ in batch]
        return self.sampler.generate([c for c, _, _, _ in batch], self.greedy,
                                     None if None in slots else slots)

    async def _run(self, loop, batch) -> None:
        start, started_at = time.perf_counter(), time.time()
        try:  # one hop to the sampler's thread and back per call: the loop's cost is per hop
            tokens, logps, version = await loop.run_in_executor(self._executor, self._call, batch)
        except Exception as error:  # reaches every waiting episode, which ends with status error
            for _, _, future, _ in batch:
                if not future.done():
                    future.set_exception(error)
            return
        self.metrics.observe("actor/inference_s", time.perf_counter() - start)
        self.metrics.observe("actor/batch_rows", len(batch))
        self.metrics.gauge("actor/compiles", self.sampler.compiles)
        self.metrics.gauge("actor/compiles_inline", self.sampler.inline_compiles)
        finished_at = time.time()
        for (_, _, future, trace), t, lp in zip(batch, tokens, logps):
            if trace is not None:
                trace[0].append((trace[1], started_at, finished_at, len(batch)))
            if not future.done():
                future.set_result((t, lp, version))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.sampler.close()
