"""Counters, gauges, windowed distributions and timers, safe to share between threads.

`Metrics.snapshot()` flattens everything into the metric names of DESIGN.md: counters and gauges
as they are, distributions as `<name>_p50`/`_p90`/`_p99` (or `_ms_p99` for millisecond series) and
`<name>_mean`. Distributions keep the last `window` observations, so percentiles follow the run
rather than its whole history.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterable, Iterator

import numpy as np


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
        if not self._values:
            return [float("nan") for _ in qs]
        return [float(v) for v in np.quantile(np.fromiter(self._values, float), list(qs))]

    def mean(self) -> float:
        return float(np.mean(self._values)) if self._values else float("nan")

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

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            dist = self.dists.get(name)
            if dist is None:
                dist = self.dists[name] = Distribution(self._window)
            dist.add(value)

    def observe_many(self, name: str, values: Iterable[float]) -> None:
        with self._lock:
            dist = self.dists.get(name)
            if dist is None:
                dist = self.dists[name] = Distribution(self._window)
            dist.extend(values)

    def average(self, name: str, value: float) -> None:
        """Adds to a windowed mean reported under `name` itself (e.g. `reward/mean`)."""
        with self._lock:
            dist = self.averages.get(name)
            if dist is None:
                dist = self.averages[name] = Distribution(self._window)
            dist.add(value)

    def average_many(self, name: str, values: Iterable[float]) -> None:
        with self._lock:
            dist = self.averages.get(name)
            if dist is None:
                dist = self.averages[name] = Distribution(self._window)
            dist.extend(values)

    @contextlib.contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Observes the wall time of the block in seconds under `name`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.observe(name, time.perf_counter() - start)

    def distribution(self, name: str) -> Distribution | None:
        with self._lock:
            return self.dists.get(name)

    def export(self) -> dict[str, dict[str, float]]:
        """The snapshot split into counters (summed across processes) and values (not)."""
        snapshot = self.snapshot()
        with self._lock:
            counters = {k: snapshot.pop(k) for k in list(self.counters)}
        return {"counters": counters, "values": snapshot}

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self.counters)
            out.update(self.gauges)
            for name, dist in self.dists.items():
                p50, p90, p99 = dist.quantiles((0.5, 0.9, 0.99))
                out[f"{name}_p50"] = p50
                out[f"{name}_p90"] = p90
                out[f"{name}_p99"] = p99
                out[f"{name}_mean"] = dist.mean()
            for name, dist in self.averages.items():
                out[name] = dist.mean()
            return out
