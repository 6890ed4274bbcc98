"""Metrics across processes: each process publishes its registry to Redis, the supervisor merges.

Every process runs a `Publisher` thread that writes `Metrics.export()` as JSON into one Redis hash
(field = component name) every `period_s` and once more when stopped. `merge` sums counters over
components and, for other values present in several components, takes the max of `_max`/`_p99`/
`_p90` series and the mean of the rest.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable

import redis

from headrace.metrics.core import Metrics

log = logging.getLogger(__name__)


def metrics_key(run_id: str) -> str:
    return f"headrace:{{{run_id}:0}}:metrics"


class Publisher:
    def __init__(self, client: redis.Redis, run_id: str, component: str, metrics: Metrics,
                 period_s: float = 0.5, extra: Callable[[], dict[str, float]] | None = None):
        self._extra = extra
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
            data["values"].update(self._extra())
        data["values"] = {k: v for k, v in data["values"].items() if math.isfinite(v)}
        self._client.hset(self._key, self._component, json.dumps(data))

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self.publish()
            except redis.RedisError as error:  # reported, retried next period
                log.warning("%s: metrics not published: %s", self._component, error)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.publish()
        except redis.RedisError:
            pass


def merge(components: dict[str, dict]) -> dict[str, float]:
    counters: dict[str, float] = {}
    values: dict[str, list[float]] = {}
    for data in components.values():
        for name, value in data.get("counters", {}).items():
            counters[name] = counters.get(name, 0.0) + value
        for name, value in data.get("values", {}).items():
            values.setdefault(name, []).append(value)
    merged = dict(counters)
    for name, items in values.items():
        if name.endswith(("_max", "_p99", "_p90")):
            merged[name] = max(items)
        else:
            merged[name] = sum(items) / len(items)
    return merged


def read(client: redis.Redis, run_id: str) -> dict[str, float]:
    raw = client.hgetall(metrics_key(run_id))
    return merge({k.decode(): json.loads(v) for k, v in raw.items()})
