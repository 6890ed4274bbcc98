"""Batching many episodes' policy calls into one engine call, and keeping weights fresh.

Episodes are coroutines on one asyncio loop; each `await policy.act(context)` parks a request. The
server task runs one batched `generate` of the engine (`headrace.engines.base.Engine`: the JAX
`Sampler`, or the vLLM engine) in a worker thread, so environment coroutines keep running, as soon
as every live episode that is not away (stepping its environment, writing to the buffer) is
waiting, when `max_batch` requests are parked, or `wait_s` after the first request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from headrace.engines.base import Engine, StoreLoading
from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.model.sampler import PromptTooLong, Sampler
from headrace.weights.base import VersionGone, WeightStore

log = logging.getLogger(__name__)


LOG_EVERY_S = 10.0  # a failing weights store is logged at most this often (and counted always)


class WeightSync:
    """Moves the engine to the newest (or, for experiments, `forced_lag`-old) published weights.

    The JAX sampler is handed the arrays (`set_params`); an engine that reads the store itself
    (`StoreLoading`: vLLM) is told the version (`load_version`).

    Checking the store and loading a version (file reads, checksums, the host-to-device copy) run
    on a thread of its own, one check at a time: `refresh` only starts one, so neither the actor's
    event loop nor the sampler's thread waits on the store. The sampler's version only moves
    forward: a load never replaces a newer version by an older one (a `forced_lag` target behind
    what is installed is skipped). Under LoRA (`model.lora`) a version holds adapters only; the
    `loader` merges them into the actor's copy of the base (one jitted program, on device), so
    the sampler runs plain weights. A failed load is counted (`weights/load_errors`), logged (at
    most every LOG_EVERY_S) and raised by the next `refresh` that raises errors, in whichever
    thread calls it, unless a later check succeeds first.
    """

    def __init__(self, store: WeightStore, sampler: Sampler | Engine, metrics: Metrics,
                 forced_lag: int = 0, poll_s: float = 0.02,
                 loader: Callable[[dict], Any] | None = None,
                 on_install: Callable[[int], None] | None = None):
        self.store = store
        # flat published weights -> device params: as they are, or (model.lora) a
        # `headrace.model.lora.Merger` that merges each version's adapters into the fixed base
        self.loader = params_lib.from_host if loader is None else loader
        self.sampler = sampler
        self.metrics = metrics
        self.forced_lag = forced_lag
        self.poll_s = poll_s
        self.on_install = on_install  # called with the version, on the weights thread
        self._next_poll = 0.0
        self._lock = threading.Lock()  # guards the poll clock, the check in flight, the error
        self._checking: concurrent.futures.Future | None = None
        self._error: BaseException | None = None
        self._quiet_until = float("-inf")
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weights")

    def refresh(self, force: bool = False,
                raise_error: bool = True) -> concurrent.futures.Future | None:
        """Starts a check for newer weights unless one is in flight or the last one began less
        than `poll_s` ago (`force`: whatever the clock says). Never blocks on the store.

        Returns:
          The future of the check in flight (started now or earlier; its result says whether the
          sampler changed), or None when no check is due.

        Raises:
          Exception: the error of the last check, if it failed (raised once; with
            `raise_error=False` it is left for the next caller that raises).
        """
        with self._lock:
            if self._error is not None and raise_error:
                error, self._error = self._error, None
                raise error
            if self._checking is not None and not self._checking.done():
                return self._checking
            now = time.monotonic()
            if not force and now < self._next_poll:
                return None
            self._next_poll = now + self.poll_s
            self._checking = self._executor.submit(self._check)
            return self._checking

    async def wait_first(self, stop: threading.Event, poll_s: float = 0.05) -> bool:
        """Waits (without blocking the loop) until some version is installed; False on stop."""
        while self.sampler.version < 0:
            if stop.is_set():
                return False
            checking = self.refresh(force=True)
            if checking is not None:
                await asyncio.wrap_future(checking)  # a failed check raises in refresh, next
            if self.sampler.version < 0:
                await asyncio.sleep(poll_s)  # actors start beside the learner
        return True

    def _check(self) -> bool:
        """On the weights thread: loads and installs the target version if it is newer."""
        try:
            latest = self.store.latest_version()
            target = max(latest - self.forced_lag, 0) if latest >= 0 else -1
            if target <= self.sampler.version:
                return False
            start = time.perf_counter()
            if isinstance(self.sampler, StoreLoading):
                try:
                    self.sampler.load_version(target)
                except VersionGone:
                    target = latest
                    self.sampler.load_version(target)
                return self._loaded(target, start)
            try:
                flat = self.store.load(target)
            except VersionGone:
                flat, target = self.store.load(latest), latest
            params = self.loader(flat)
            # Deliberate sync, on this thread: the copy (and a LoRA merge) completes here, not in
            # the first sampler call that uses the new weights.
            jax.block_until_ready(params)
            if target <= self.sampler.version:  # only this thread installs; kept as the rule
                return False
            self.sampler.set_params(params, target)
        except Exception as error:
            self.metrics.count("weights/load_errors")
            now = time.monotonic()
            if now >= self._quiet_until:  # checks repeat every poll_s: one warning in LOG_EVERY_S
                self._quiet_until = now + LOG_EVERY_S
                log.warning("loading weights failed: %s: %s", type(error).__name__, error)
            with self._lock:
                self._error = error
            return False
        return self._loaded(target, start)

    def _loaded(self, target: int, start: float) -> bool:
        with self._lock:
            self._error = None  # recovered: an earlier failure not raised yet is moot
        self.metrics.observe("weights/pickup_s", time.perf_counter() - start)
        self.store.note_pickup(target, time.time())  # closes the loop for traces
        if self.on_install is not None:
            self.on_install(target)
        return True

    def close(self) -> None:
        """Stops the weights thread after the check in flight, if any (not waiting for it)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


class BatchedPolicy:
    """Coroutine-facing front of an engine (a `Sampler`, or any `Engine`); one per event loop."""

    def __init__(self, sampler: Sampler | Engine, metrics: Metrics, *, max_batch: int, wait_s: float,
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
                self.sampler.release(slot)  # the next episode there starts afresh
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
        """Generates one turn for `context`: (tokens, behaviour log-probs, weights version):
        the version an int, or an int32 array of one version per token when the engine installed
        a version while the call was in flight (the vLLM engine).

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
        per_row = [version] * len(batch) if isinstance(version, int) else version
        for (_, _, future, trace), t, lp, v in zip(batch, tokens, logps, per_row):
            if trace is not None:
                trace[0].append((trace[1], started_at, finished_at, len(batch)))
            if not future.done():
                future.set_result((t, lp, v))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.sampler.close()
