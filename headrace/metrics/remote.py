"""Metrics across processes: each process publishes its registry to Redis, the supervisor merges.

Every process runs a `Publisher` thread that writes `Metrics.export()` as JSON into one Redis hash
(field = component name) every `period_s` and once more when stopped. A Redis error is logged and
retried next period; any other error ends the thread: it calls `on_failure` (the process's stop)
and `stop()` raises it, so the process ends as failed instead of running on without metrics.
`merge` sums counters over components and combines each other value present in several components
as its producer declared (`headrace.metrics.core`: a tail percentile or a declared maximum takes
the max, the rest the mean).
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable

import redis

from headrace.metrics.core import MAX, MEAN, SUM, Metrics, reduction

log = logging.getLogger(__name__)


def metrics_key(run_id: str) -> str:
    return f"headrace:{{{run_id}:0}}:metrics"


class PublisherError(RuntimeError):
    """The metrics publisher thread failed (not a Redis error: those are retried)."""


class Publisher:
    def __init__(self, client: redis.Redis, run_id: str, component: str, metrics: Metrics,
                 period_s: float = 0.5, extra: Callable[[], dict[str, float]] | None = None,
                 on_failure: Callable[[], None] | None = None):
        """`extra`: more values each period (a buffer's `stats`); their reductions are those
        declared with `metrics.core.declare` (a mean when none is)."""
        self._extra = extra
        self._on_failure = on_failure
        self.error: BaseException | None = None
        self._client = client
        self._key = metrics_key(run_id)
        self._component = component
        self._metrics = metrics
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{component}-metrics", daemon=True)

    def start(self) -> Publisher:
        self._thread.start()
        return self

    def publish(self) -> None:
        data = self._metrics.export()
        if self._extra is not None:
            extra = self._extra()
            data["values"].update(extra)
            data["reduce"].update((k, reduction(k)) for k in extra if reduction(k) != MEAN)
        data["values"] = {k: v for k, v in data["values"].items() if math.isfinite(v)}
        self._client.hset(self._key, self._component, json.dumps(data))

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self.publish()
            except redis.RedisError as error:  # reported, retried next period
                log.warning("%s: metrics not published: %s", self._component, error)
            except Exception as error:  # noqa: BLE001 - kept for stop() to raise
                log.error("%s: the metrics publisher failed: %r", self._component, error)
                self.error = error
                if self._on_failure is not None:
                    self._on_failure()
                return

    def stop(self) -> None:
        """Stops the thread and publishes once more.

        Raises:
          PublisherError: the thread had failed (the cause chained).
        """
        self._stop.set()
        self._thread.join(timeout=5)
        if self.error is not None:
            raise PublisherError(f"{self._component}: the metrics publisher failed: "
                                 f"{self.error!r}") from self.error
        try:
            self.publish()
        except redis.RedisError:
            pass


def merge(components: dict[str, dict]) -> dict[str, float]:
    """One snapshot of every component's `Metrics.export()`: counters summed, each value reduced
    as its `reduce` declares (a mean when none does)."""
    counters: dict[str, float] = {}
    values: dict[str, list[float]] = {}
    reduce: dict[str, str] = {}
    for data in components.values():
        for name, value in data.get("counters", {}).items():
            counters[name] = counters.get(name, 0.0) + value
        for name, value in data.get("values", {}).items():
            values.setdefault(name, []).append(value)
        reduce.update(data.get("reduce", {}))
    merged = dict(counters)
    combine = {SUM: sum, MAX: max, MEAN: lambda items: sum(items) / len(items)}
    for name, items in values.items():
        merged[name] = combine[reduce.get(name, MEAN)](items)
    return merged


def read(client: redis.Redis, run_id: str) -> dict[str, float]:
    raw = client.hgetall(metrics_key(run_id))
    return merge({k.decode(): json.loads(v) for k, v in raw.items()})
