"""In-process weight store for single-process runs and tests."""

from __future__ import annotations

import collections
import threading

from headrace.weights.base import Params, VersionGone, WeightStore


class MemoryWeightStore(WeightStore):
    """Keeps the last `keep` versions in a dict; arrays are shared, not copied (treat as read-only)."""

    def __init__(self, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep={keep}: must be >= 1")
        self._keep = keep
        self._versions: collections.OrderedDict[int, Params] = collections.OrderedDict()
        self._lock = threading.Lock()

    def publish(self, params: Params, version: int) -> None:
        with self._lock:
            newest = next(reversed(self._versions)) if self._versions else -1
            if version <= newest:
                raise ValueError(f"version {version} is not newer than {newest}")
            self._versions[version] = dict(params)
            while len(self._versions) > self._keep:
                self._versions.popitem(last=False)

    def latest_version(self) -> int:
        with self._lock:
            return next(reversed(self._versions)) if self._versions else -1

    def load(self, version: int) -> Params:
        with self._lock:
            if version not in self._versions:
                raise VersionGone(f"weights version {version} is not kept "
                                  f"(kept: {list(self._versions)})")
            return self._versions[version]
