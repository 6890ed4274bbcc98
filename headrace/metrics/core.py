"""Counters, gauges, windowed distributions and averages, safe to share between threads.

`Metrics.snapshot()` flattens everything into the metric names of docs/metrics.md: counters and
gauges as they are, distributions as `<name>_p50`/`_p90`/`_p99` and `<name>_mean`. Distributions
keep the last `window` observations, so percentiles follow the run rather than its whole history.

How a metric's values from several processes combine (`metrics.remote.merge`) is declared with
the metric, never read off its name: counters add up (SUM); a distribution's tail series
(`_p90`, `_p99`) take the worst process's (MAX), its `_p50` and `_mean` the mean; a gauge is
averaged unless the module that names it declares otherwise (`declare("staleness/lag_max",
MAX)`), and `export` carries the declarations to the merge.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable

import numpy as np

SUM, MEAN, MAX = "sum", "mean", "max"
REDUCTIONS = (SUM, MEAN, MAX)
# A distribution's series: (suffix, quantile or None for the mean, reduction across processes)
SERIES = (("_p50", 0.5, MEAN), ("_p90", 0.9, MAX), ("_p99", 0.99, MAX), ("_mean", None, MEAN))
_DECLARED: dict[str, str] = {}


def declare(name: str, reduce: str) -> str:
    """Declares how the gauge (or `extra` value) `name` combines across processes; returns it.

    Raises:
      ValueError: an unknown reduction, or `name` declared before with another one.
    """
    if reduce not in REDUCTIONS:
        raise ValueError(f"{name}: reduction {reduce!r} is not one of {REDUCTIONS}")
    if _DECLARED.setdefault(name, reduce) != reduce:
        raise ValueError(f"{name}: declared {_DECLARED[name]!r} before, now {reduce!r}")
    return name


def reduction(name: str) -> str:
    """The declared reduction of a gauge or `extra` value (MEAN when none was declared)."""
    return _DECLARED.get(name, MEAN)


class Distribution:
    """The last `window` observations of one quantity."""

    def __init__(self, window: int = 4096):
        self._values: collections.deque[float] = collections.deque(maxlen=window)
        self.count = 0
        self.total = 0.0

    def add(self, value: float) -> None:
        self._values.append(float(value))
        self.count += 1
        self.total += float(value)

    def extend(self, values: Iterable[float]) -> None:
        for value in values:
            self.add(value)

    def quantiles(self, qs: Iterable[float]) -> list[float]:
        return self.summary(qs)[0]

    def summary(self, qs: Iterable[float]) -> tuple[list[float], float]:
        """(the quantiles `qs`, the mean) of the window, from one copy of it."""
        if not self._values:
            return [float("nan") for _ in qs], float("nan")
        values = np.fromiter(self._values, float, len(self._values))
        return [float(v) for v in np.quantile(values, list(qs))], float(values.mean())

    def mean(self) -> float:
        # a builtin sum: numpy would first convert the deque element by element, 5x slower
        return sum(self._values) / len(self._values) if self._values else float("nan")

    def max(self) -> float:
        return max(self._values) if self._values else float("nan")


class RateMeter:
    """Events per second over a sliding time window."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._events: collections.deque[tuple[float, float]] = collections.deque()
        self.total = 0.0
        self._start = time.monotonic()

    def add(self, n: float = 1.0, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._events.append((now, n))
        self.total += n
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        span = min(self.window_s, max(now - self._start, 1e-9))
        return sum(n for _, n in self._events) / span


class Metrics:
    """A thread-safe registry; one per process component, merged by the runtime's reporter."""

    def __init__(self, window: int = 4096):
        self._lock = threading.Lock()
        self._window = window
        self.counters: dict[str, float] = collections.defaultdict(float)
        self.gauges: dict[str, float] = {}
        self.dists: dict[str, Distribution] = {}
        self.averages: dict[str, Distribution] = {}

    def count(self, name: str, n: float = 1.0) -> None:
        with self._lock:
            self.counters[name] += n

    def gauge(self, name: str, value: float) -> None:
        with self._lock:
            self.gauges[name] = float(value)

    def _series(self, table: dict[str, Distribution], name: str) -> Distribution:
        """`table[name]`, made on first use (the caller holds the lock)."""
        dist = table.get(name)
        if dist is None:
            dist = table[name] = Distribution(self._window)
        return dist

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self._series(self.dists, name).add(value)

    def observe_many(self, name: str, values: Iterable[float]) -> None:
        with self._lock:
            self._series(self.dists, name).extend(values)

    def average(self, name: str, value: float) -> None:
        """Adds to a windowed mean reported under `name` itself (e.g. `reward/mean`)."""
        with self._lock:
            self._series(self.averages, name).add(value)

    def average_many(self, name: str, values: Iterable[float]) -> None:
        with self._lock:
            self._series(self.averages, name).extend(values)

    def distribution(self, name: str) -> Distribution | None:
        with self._lock:
            return self.dists.get(name)

    def export(self) -> dict[str, dict]:
        """The snapshot split into counters (summed across processes) and values, with `reduce`:
        the reduction of every value that is not a mean (see the module docstring)."""
        with self._lock:  # one hold: a counter made after the snapshot is not in it
            snapshot = self._snapshot()
            counters = {k: snapshot.pop(k) for k in list(self.counters)}
            reduce = {f"{name}{suffix}": r for name in self.dists
                      for suffix, _, r in SERIES if r != MEAN}
        reduce.update((k, reduction(k)) for k in snapshot if reduction(k) != MEAN)
        return {"counters": counters, "values": snapshot, "reduce": reduce}

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> dict[str, float]:
        """Every metric's current value (the caller holds the lock)."""
        out: dict[str, float] = dict(self.counters)
        out.update(self.gauges)
        quantiles = [q for _, q, _ in SERIES if q is not None]
        for name, dist in self.dists.items():
            values, mean = dist.summary(quantiles)
            values = iter(values)
            for suffix, q, _ in SERIES:
                out[f"{name}{suffix}"] = next(values) if q is not None else mean
        for name, dist in self.averages.items():
            out[name] = dist.mean()
        return out
