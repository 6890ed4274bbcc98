"""The learner's step clock: device time per step, utilisation, compile time and CPU share.

`StepClock.step` times one train step from its dispatch to its completion. The completion is
waited for on a waiter thread (`Timing.wait_for`), so the training thread is free to build the
next batch while the device runs, and `learner/step_s` and `learner/utilization` count device
time, not the overlapped host work. Utilisation is the steady state's: a step that compiled a new
shape is warm-up, left out of it (and of the rates and `learner/cpu_frac`) and counted in
`learner/compile_s`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import Iterator

import jax

from headrace.metrics import compiles
from headrace.metrics.core import Metrics


def _wait(step_metrics: dict) -> tuple[dict, float]:
    """The step's metrics on the host, and when the step completed (perf_counter)."""
    host = jax.device_get(step_metrics)
    return host, time.perf_counter()


@dataclasses.dataclass
class Timing:
    """One step as the clock saw it: filled in when the `step` block ends."""

    began: float  # unix time at dispatch (for traces)
    metrics: dict | None = None  # the step's metrics on the host
    compiled: bool = False  # a new shape was compiled during the step
    _done: concurrent.futures.Future | None = None
    _waiter: concurrent.futures.ThreadPoolExecutor | None = None

    def wait_for(self, step_metrics: dict) -> None:
        """Starts waiting for the dispatched step (its metrics are device arrays) to complete.

        Deliberate sync, on the waiter thread: the step is timed to its completion and its
        metrics come to the host, while the caller's thread builds the next batch."""
        self._done = self._waiter.submit(_wait, step_metrics)


class StepClock:
    """Times train steps and keeps the `learner/*` time gauges. Used from one thread."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.steps = 0  # steps timed by this clock (a resumed learner's count from its restart)
        self._first_step_at: float | None = None
        self._finished: float | None = None  # when the last step completed (perf_counter)
        self._busy_s = 0.0
        self._compile_s = 0.0  # steps that compiled a new shape (warm-up, not utilisation)
        self._cpu_at_first = 0.0  # this process's CPU time when the first step began
        self._compile_cpu_s = 0.0  # of it, what steps that compiled used
        self._compiled_steps = 0
        self._tokens = 0
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="learner-wait")
        compiles.install()

    @contextlib.contextmanager
    def step(self, tokens: int, host_s: float = 0.0) -> Iterator[Timing]:
        """Times the step dispatched in the block (which calls `Timing.wait_for` on its metrics);
        on leaving, waits for it and records it. `tokens`: the batch's real tokens; `host_s`:
        the host time this batch took to gather and build before the step (left out of
        `learner/between_steps_s`). A block that raises records nothing."""
        compiled_before = compiles.compiles("train_step")
        timing = Timing(began=time.time(), _waiter=self._waiter)
        start, cpu_start = time.perf_counter(), time.process_time()
        if self._finished is not None:  # host time between steps a fed learner also spends
            self.metrics.observe("learner/between_steps_s",
                                 max(0.0, start - self._finished - host_s))
        yield timing
        if timing._done is None:
            raise RuntimeError("StepClock.step: the block dispatched no step (wait_for)")
        timing.metrics, self._finished = timing._done.result()
        timing.compiled = compiles.compiles("train_step") != compiled_before
        self.record(self._finished - start, start, cpu_start, tokens, timing.compiled)

    def record(self, elapsed: float, start: float, cpu_start: float, tokens: int,
               compiled: bool) -> None:
        """Records a completed step (`elapsed`: dispatch to completion; `start`, `cpu_start`: the
        clock and the process's CPU time at dispatch; `compiled`: a new shape was compiled
        during it)."""
        if self._first_step_at is None:
            self._first_step_at, self._cpu_at_first = start, cpu_start
        self.steps += 1
        if compiled:
            self._compile_s += elapsed
            self._compile_cpu_s += time.process_time() - cpu_start
            self._compiled_steps += 1
        else:
            self._busy_s += elapsed
            self._tokens += tokens
        window = max(time.perf_counter() - self._first_step_at - self._compile_s, 1e-9)
        m = self.metrics
        m.observe("learner/step_s", elapsed)
        m.gauge("learner/utilization", self.utilization)
        m.gauge("learner/compile_s", self._compile_s)
        m.gauge("learner/tokens_per_s", self._tokens / window)
        m.gauge("learner/steps_per_s", (self.steps - self._compiled_steps) / window)
        # The process's CPU over the same window: with the steps per second, what a step costs
        # its cores all told (the audit's consume rate).
        m.gauge("learner/cpu_frac",
                (time.process_time() - self._cpu_at_first - self._compile_cpu_s) / window)
        m.gauge("learner/compiles", compiles.compiles("train_step"))

    @property
    def utilization(self) -> float:
        """Busy share of the time since the first step began, steps that compiled left out of
        both (a compile is warm-up: the time it took is `learner/compile_s`)."""
        if self._first_step_at is None:
            return 0.0
        window = time.perf_counter() - self._first_step_at - self._compile_s
        return self._busy_s / max(window, 1e-9)

    def close(self) -> None:
        self._waiter.shutdown(wait=False)
