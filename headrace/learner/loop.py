"""The learner loop: reader -> staleness gate -> batcher -> train step -> publish -> acknowledge.

A reader thread pulls entries from the buffer into a bounded queue (decoding happens there, off the
training thread). The training thread gathers `groups_per_batch` groups that pass the gate, builds
the batch and runs the jitted step. Version `v` are the weights after the `v * publish_every`-th
step; a batch is trained at the current version, which is what the gate measures lag against.

Acknowledgement: entries are acknowledged after the checkpoint that covers them when checkpointing
is on, else right after their step (nothing is durable then anyway). Dropped entries are
acknowledged with the trained ones; their counts live in the metrics (and in checkpoints).

Stopping: `stop` ends both threads; the learner publishes its last weights before returning.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import jax
import numpy as np

from headrace.buffer.admission import Admission
from headrace.buffer.base import Buffer
from headrace.config import Config
from headrace.learner.batching import Batcher
from headrace.learner.gate import StalenessGate
from headrace.learner.train_step import init_state, make_optimizer, make_train_step
from headrace.metrics import compiles
from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.types import Entry
from headrace.weights.base import WeightStore

log = logging.getLogger(__name__)


class Learner:
    def __init__(self, config: Config, graphdef, params, buffer: Buffer, weights: WeightStore,
                 metrics: Metrics, stop: threading.Event, allowed_v: np.ndarray | None = None,
                 admission: Admission | None = None):
        self.config = config
        self.admission = admission
        self.buffer = buffer
        self.weights = weights
        self.metrics = metrics
        self.stop = stop
        lc = config.learner
        optimizer = make_optimizer(lc.optimizer)
        self.state = init_state(params, optimizer, lc.kl_coef)
        self._train_step = make_train_step(graphdef, lc, config.sampling.temperature, optimizer,
                                           allowed_v)
        self.gate = StalenessGate(config.staleness, metrics)
        self.batcher = Batcher(lc, config.shapes, metrics)
        self.step = 0
        self.version = 0
        self._since_publish = 0
        self.trained_ids: set[str] = set()
        self._unacked: list[str] = []
        self._queue: queue.Queue[Entry] = queue.Queue(maxsize=2 * lc.groups_per_batch)
        self._first_step_at: float | None = None
        self._busy_s = 0.0
        self._tokens = 0
        self._gathered = 0  # entries taken off the queue for the batch being assembled
        self.done = threading.Event()
        compiles.install()

    # --- weights -------------------------------------------------------------------------------

    def publish(self) -> None:
        start = time.perf_counter()
        self.weights.publish(params_lib.to_host(self.state.params), self.version)
        self.metrics.observe("weights/publish_s", time.perf_counter() - start)
        self._since_publish = 0

    def _report_state(self) -> None:
        """Tells admission control where the learner is (version, steps since publish, queue)."""
        if self.admission is not None:
            step_s = self.metrics.distribution("learner/step_s")
            self.admission.learner_update(self.version, self._since_publish,
                                          self._queue.qsize() + self._gathered,
                                          step_s.mean() if step_s is not None else 0.0)

    # --- reading -------------------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while not self.stop.is_set():
                room = self._queue.maxsize - self._queue.qsize()
                if room <= 0:
                    time.sleep(0.001)
                    continue
                entries = self.buffer.get(room, timeout_s=0.1)
                for entry in entries:
                    self._queue.put(entry)
                if entries:
                    self._report_state()
        except Exception:
            log.exception("learner reader failed")
            self.stop.set()
            raise

    def _gather(self) -> list[Entry] | None:
        """Blocks until groups_per_batch entries pass the gate; None once stopping."""
        entries: list[Entry] = []
        need = self.config.learner.groups_per_batch
        while len(entries) < need:
            try:
                entry = self._queue.get(timeout=0.05)
            except queue.Empty:
                if self.stop.is_set():
                    return None
                continue
            if entry.id in self.trained_ids:  # redelivered after we trained on it
                self.metrics.count("learner/skipped_redelivered")
                self._unacked.append(entry.id)
                continue
            if self.gate.check(entry.group, self.version) is not None:
                self._unacked.append(entry.id)
                continue
            entries.append(entry)
            self._gathered = len(entries)
        return entries

    # --- training ------------------------------------------------------------------------------

    def run(self) -> None:
        """Trains until `stop` is set or `run.max_steps` is reached (blocking)."""
        reader = threading.Thread(target=self._read, name="learner-reader", daemon=True)
        reader.start()
        try:
            self._loop()
        finally:
            self.done.set()
            reader.join(timeout=5)
            if self._since_publish:
                self.version += 1
                self.publish()
            self._flush_acks()

    def _loop(self) -> None:
        run = self.config.run
        while not self.stop.is_set():
            if run.max_steps and self.step >= run.max_steps:
                return
            wait_start = time.perf_counter()
            entries = self._gather()
            if entries is None:
                return
            self.metrics.observe("learner/wait_data_s", time.perf_counter() - wait_start)
            with self.metrics.timer("learner/batch_s"):
                batch = self.batcher.build([e.group for e in entries])
                self._record_staleness(entries)
            self._train(batch)
            self.trained_ids.update(e.id for e in entries)
            self._unacked.extend(e.id for e in entries)
            self._since_publish += 1
            if self._since_publish >= self.config.learner.publish_every:
                self.version += 1
                self.publish()
            self._gathered = 0
            self._report_state()
            if not run.checkpoint_every:
                self._flush_acks()

    def _train(self, batch) -> None:
        start = time.perf_counter()
        if self._first_step_at is None:
            self._first_step_at = start
        # One call per microbatch, dispatched without waiting; `batch.updates` optimizer updates.
        self.state, step_metrics = self._train_step(self.state, batch)
        # Deliberate sync: the step's time is measured to completion, and metrics go to the host.
        step_metrics = jax.device_get(step_metrics)
        elapsed = time.perf_counter() - start
        self.step += 1
        self._busy_s += elapsed
        self._tokens += batch.real_tokens
        wall = time.perf_counter() - self._first_step_at
        m = self.metrics
        m.observe("learner/step_s", elapsed)
        m.gauge("learner/utilization", self._busy_s / wall)
        m.gauge("learner/tokens_per_s", self._tokens / wall)
        m.gauge("learner/steps_per_s", self.step / wall)
        m.gauge("learner/step", self.step)
        m.gauge("learner/version", self.version)
        m.gauge("learner/compiles", compiles.compiles("train_step"))
        m.gauge("learner/updates_per_trajectory", 1.0)  # each trajectory is in one minibatch
        for name, value in step_metrics.items():
            m.gauge(name, float(value))

    def _record_staleness(self, entries: list[Entry]) -> None:
        now = time.time()
        groups = [e.group for e in entries]
        lags = np.array([self.version - g.oldest_version for g in groups])
        gen = np.array([g.put_version - g.oldest_version for g in groups])
        m = self.metrics
        m.gauge("staleness/lag_mean", float(lags.mean()))
        m.gauge("staleness/lag_max", float(lags.max()))
        m.gauge("staleness/lag_gen_mean", float(gen.mean()))
        m.gauge("staleness/lag_queue_mean", float((lags - gen).mean()))
        m.observe_many("staleness/age_s", [now - g.started for g in groups])
        m.count("learner/groups", len(groups))
        m.count("learner/trajectories", sum(len(g.trajectories) for g in groups))
        m.count("buffer/redelivered_trained", sum(e.delivery_count > 1 for e in entries))

    def _flush_acks(self) -> None:
        if self._unacked:
            self.buffer.ack(self._unacked)
            self._unacked = []

    @property
    def utilization(self) -> float:
        if self._first_step_at is None:
            return 0.0
        return self._busy_s / max(time.perf_counter() - self._first_step_at, 1e-9)
