"""The learner's weights publisher: versions to the weight store, evaluation points to the pins.

The device-to-host copy happens on the training thread (a deliberate sync: the next step donates
the state); writing to a store runs on the publisher thread, one write at a time and in order, so
a slow store (files, fsync) does not hold up training. Several learner processes: gathering the
parameters is a collective every process joins; process 0 alone writes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time

from headrace.learner.feed import LearnerError
from headrace.learner.train_step import compute_params
from headrace.metrics.core import Metrics
from headrace.metrics.traces import Tracer
from headrace.model import params as params_lib
from headrace.model.dims import ModelDims
from headrace.parallel import multihost
from headrace.weights.base import WeightStore

log = logging.getLogger(__name__)


class Publisher:
    def __init__(self, weights: WeightStore, pins: WeightStore | None, metrics: Metrics,
                 tracer: Tracer, dims: ModelDims, processes: int, primary: bool):
        self.weights = weights
        self.pins = pins
        self.metrics = metrics
        self.tracer = tracer
        self.dims = dims
        self.processes = processes
        self.primary = primary
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="learner-pub")
        self._publishing: concurrent.futures.Future | None = None

    def _host(self, master_params) -> dict | None:
        """The parameters in `model.dtype`, as published, on this host (process 0; None on the
        others). Deliberate sync: the next step donates the state."""
        params = compute_params(master_params, self.dims)
        if self.processes > 1:
            params = multihost.host_params(params)  # a collective: every process joins
        return params_lib.to_host(params) if self.primary else None

    def publish(self, master_params, version: int) -> None:
        """Publishes `master_params` as `version` (`wait`: until the store holds it). A failed
        write is raised by the next publish (or `wait`)."""
        began = time.time()
        host = self._host(master_params)
        self.wait()  # the previous version first: versions appear in order
        self.tracer.published(version, began)  # actors may load it before publish returns
        if host is not None:
            self._publishing = self._writer.submit(self._write, host, version)

    def _write(self, host: dict, version: int) -> None:
        start = time.perf_counter()
        try:
            self.weights.publish(host, version)
        except Exception as error:
            raise LearnerError(f"the weights publisher failed on version {version}: "
                               f"{type(error).__name__}: {error}") from error
        self.metrics.observe("weights/publish_s", time.perf_counter() - start)

    def pin(self, master_params, step: int) -> None:
        """Writes the weights of `step` to the pins (keyed by the step), after the publishes
        before it; a failed or stale pin (a resumed run pinned this step before its crash) is
        logged and counted (`eval/pins_skipped`), never fatal to training. Several processes:
        every one calls it (process 0 alone has the pins)."""
        if self.pins is None and self.processes == 1:
            return
        host = self._host(master_params)
        if host is not None and self.pins is not None:
            self._writer.submit(self._write_pin, host, step)

    def _write_pin(self, host: dict, step: int) -> None:
        try:
            if step <= self.pins.latest_version():
                raise ValueError(f"step {step} is not after the newest pin, "
                                 f"{self.pins.latest_version()}")
            self.pins.publish(host, step)
        except Exception as error:  # an evaluation point lost, not the run
            self.metrics.count("eval/pins_skipped")
            log.warning("pinning the weights of step %d for evaluation failed: %s", step, error)

    def wait(self) -> None:
        """Blocks until the last publish is in the store (re-raising its error)."""
        if self._publishing is not None:
            future, self._publishing = self._publishing, None
            future.result()

    def close(self) -> None:
        self._writer.shutdown(wait=False)
