"""The learner loop: reader -> staleness gate -> batcher -> train step -> publish -> acknowledge.

A reader thread pulls entries from the buffer into a bounded queue (decoding happens there, off the
training thread). The training thread gathers `groups_per_batch` groups that pass the gate, builds
the batch and runs the jitted step. Version `v` are the weights after the `v * publish_every`-th
step; a batch is trained at the current version, which is what the gate measures lag against.
While the device runs step k, the training thread gathers and builds step k+1's batch from what is
already queued, gated at the version step k+1 will be trained at (known in advance: one more when
step k publishes); a waiter thread times step k to its completion, so `learner/step_s` and
`learner/utilization` count device time, not the overlapped host work. Utilisation is the
steady state's: a step that compiled a new shape is warm-up, left out of it and counted in
`learner/compile_s`.

Checkpoints and acknowledgement (DESIGN.md, "Buffer contract"). With a checkpointer and
`run.checkpoint_every` > 0 the learner saves every `checkpoint_every` steps: the train state, and
metadata holding the learner step, the weights version, the ids of the entries handled (trained,
dropped, skipped) and not yet acknowledged, and every counter of its metrics (drops by reason,
groups, trajectories, redeliveries). Only once the save is complete does it acknowledge those
entries. After a crash the restarted learner restores the latest checkpoint: entries trained after
it were never acknowledged, so the buffer redelivers them and they are trained again (their
updates died with the crash); a redelivered entry the checkpoint covers (a crash between save and
acknowledgement) is acknowledged and skipped, counted in `buffer/redelivered_skipped`, never
trained twice. When every pending entry the buffer allows is already handled but unacknowledged
(dropped ones pile up), the learner checkpoints early rather than wait for data that cannot come.
Without a checkpointer, or with `checkpoint_every` = 0, entries are acknowledged right after their
step (a crash then loses them); a checkpointer still saves at the end. A ledger, when given,
records every entry handled and is made durable before each save (`headrace.runtime.resume`).
Several learner processes (`parallel.processes`) save each checkpoint together, and process 0
writes metadata holding every process's entries and counters (`headrace.parallel.multihost`).

Stopping: `stop` ends both threads; the learner publishes its last weights and, when it stopped
cleanly, saves a final checkpoint and acknowledges everything it handled. After an error nothing
more is acknowledged (the entries come back to a resumed learner).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import pathlib
import queue
import threading
import time

import jax
import numpy as np

from headrace.audit.traces import Tracer
from headrace.buffer.admission import Admission
from headrace.buffer.base import Buffer
from headrace.config import Config
from headrace.learner.batching import Batcher
from headrace.learner.gate import StalenessGate
from headrace.learner.train_step import init_state, make_optimizer
from headrace.metrics import compiles
from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.parallel import multihost
from headrace.parallel.step import ShardedTrainStep, learner_step
from headrace.types import Entry
from headrace.weights.base import WeightStore

log = logging.getLogger(__name__)


def _wait(step_metrics: dict) -> tuple[dict, float]:
    """The step's metrics on the host, and when the step completed (perf_counter)."""
    host = jax.device_get(step_metrics)
    return host, time.perf_counter()


class Learner:
    def __init__(self, config: Config, graphdef, params, buffer: Buffer, weights: WeightStore,
                 metrics: Metrics, stop: threading.Event, allowed_v: np.ndarray | None = None,
                 admission: Admission | None = None, checkpointer=None, ledger=None,
                 trace_path: pathlib.Path | None = None):
        """Builds the learner; with a `checkpointer` holding a checkpoint, restores the latest.

        Args:
          checkpointer: saves and restores checkpoints (`headrace.runtime.checkpoint.Checkpointer`
            or the same methods: save, restore, latest_step); None: no checkpoints.
          ledger: records what is done with each entry (`headrace.runtime.resume.Ledger`: begin,
            record, mark); None: no ledger.
          trace_path: where traced groups are written (traces.jsonl); None: stage metrics only.

        Raises:
          ValueError: the checkpoint does not match this model and optimizer.
        """
        self.config = config
        self.admission = admission
        self.buffer = buffer
        self.weights = weights
        self.metrics = metrics
        self.stop = stop
        lc = config.learner
        optimizer = make_optimizer(lc.optimizer)
        # One device, or a mesh (`parallel.mesh`): then the state lives sharded on it, and every
        # microbatch's rows divide by the mesh's data x fsdp.
        self._train_step, row_multiple = learner_step(config, graphdef, optimizer, allowed_v)
        # Several learner processes (`parallel.processes`): process 0 alone writes weights and
        # talks to admission control; batches are agreed with the others (`multihost`).
        self.processes = jax.process_count()
        self.primary = jax.process_index() == 0
        self.state = init_state(params, optimizer, lc.kl_coef)
        if isinstance(self._train_step, ShardedTrainStep):
            self.state = self._train_step.place(self.state)
        self.gate = StalenessGate(config.staleness, metrics)
        self.peers = multihost.Peers() if self.processes > 1 else None
        self.batcher = Batcher(lc, config.shapes, metrics, row_multiple=row_multiple,
                               peers=self.peers)
        self.step = 0
        self.version = 0
        self._since_publish = 0
        self.trained_ids: set[str] = set()
        self._unacked: list[str] = []
        self._queue: queue.Queue[Entry] = queue.Queue(maxsize=2 * lc.groups_per_batch)
        self._first_step_at: float | None = None
        self._busy_s = 0.0
        self._compile_s = 0.0  # steps that compiled a new shape (warm-up, not utilisation)
        self._cpu_at_first = 0.0  # this process's CPU time when the first step began
        self._compile_cpu_s = 0.0  # of it, what steps that compiled used
        self._compiled_steps = 0
        self._tokens = 0
        self.done = threading.Event()
        self.tracer = Tracer(trace_path, weights, metrics)
        self._carry: list[Entry] = []  # passed the gate, not yet in a batch (gated again on use)
        self._wants_checkpoint = False  # several processes: put to the vote at the next step
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="learner-wait")
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="learner-pub")
        self._publishing: concurrent.futures.Future | None = None
        compiles.install()
        self.checkpointer = checkpointer
        self.ledger = ledger
        self._reader_stop = threading.Event()
        self._checkpoint_key: int | None = None  # the newest checkpoint saved or restored
        self._checkpoint_step = 0  # the learner step it holds
        self.restored_from = self._restore() if checkpointer is not None else None
        if ledger is not None:
            ledger.begin(self.restored_from)

    # --- weights -------------------------------------------------------------------------------

    def publish(self, wait: bool = False) -> None:
        """Publishes the current weights as `self.version`.

        The device-to-host copy happens here (a deliberate sync: the next step donates the
        state); writing to the store runs on the publisher thread, one version at a time and in
        order, so a slow store (files, fsync) does not hold up training. `wait`: return once the
        store holds this version. A failed write is raised by the next publish (or the end).
        """
        began = time.time()
        params = self.state.params
        if self.processes > 1:
            params = multihost.host_params(params)  # a collective: every process joins
        host = params_lib.to_host(params) if self.primary else None
        self.wait_published()  # the previous version first: versions appear in order
        self.tracer.published(self.version, began)  # actors may load it before publish returns
        self._since_publish = 0
        if host is not None:
            self._publishing = self._writer.submit(self._write, host, self.version)
            if wait:
                self.wait_published()

    def _write(self, host: dict, version: int) -> None:
        start = time.perf_counter()
        self.weights.publish(host, version)
        self.metrics.observe("weights/publish_s", time.perf_counter() - start)

    def wait_published(self) -> None:
        """Blocks until the last publish is in the store (re-raising its error)."""
        if self._publishing is not None:
            future, self._publishing = self._publishing, None
            future.result()

    def publish_start(self) -> None:
        """Publishes the starting weights unless the store already holds them: version 0 on a
        fresh run; after a resume whose store went past the checkpoint (versions published after
        it, from updates lost with the crash), the restored weights as the next version."""
        latest = self.weights.latest_version()
        if self.peers is not None:  # every process takes the same branch (publish is collective)
            latest = int(self.peers.gather(np.array([latest])).max())
        if latest == self.version:
            return
        self.version = max(self.version, latest + 1)
        self.publish(wait=True)
        self.metrics.gauge("learner/version", self.version)
        self._report_state()

    def _report_state(self) -> None:
        """Tells admission control where the learner is: version, steps since publish, and the
        entries handled but not yet acknowledged (admission counts the rest of the buffer's
        pending entries as this learner's queue). Only the training thread reports, so reports
        stay in order."""
        if self.admission is not None:  # each learner process reports its own
            step_s = self.metrics.distribution("learner/step_s")
            self.admission.learner_update(self.version, self._since_publish, len(self._unacked),
                                          step_s.mean() if step_s is not None else 0.0,
                                          host=str(jax.process_index()))

    # --- reading -------------------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while not (self.stop.is_set() or self._reader_stop.is_set()):
                room = self._queue.maxsize - self._queue.qsize()
                if room <= 0:
                    time.sleep(0.001)
                    continue
                entries = self.buffer.get(room, timeout_s=0.1)
                if entries:
                    self.tracer.read(entries)
                for entry in entries:
                    self._queue.put(entry)
        except Exception:
            log.exception("learner reader failed")
            self.stop.set()
            raise

    def _admit(self, entry: Entry, version: int) -> bool:
        """Whether `entry` goes into a batch trained at `version`; a skip or drop is recorded."""
        if entry.id in self.trained_ids:  # redelivered; a checkpoint already covers it
            self.metrics.count("buffer/redelivered_skipped")
            self._handled("skipped", [entry])
            return False
        reason = self.gate.check(entry.group, version)
        if reason is not None:
            self._handled("dropped", [entry], reason)
            return False
        self.tracer.gated(entry)
        return True

    def _gather(self, version: int, block: bool = True) -> list[Entry] | None:
        """groups_per_batch entries that pass the gate at `version` (the version the batch will be
        trained at). Blocking: waits for them; None once stopping. Not blocking: takes only what is
        queued already; None (keeping what passed for the next call) when that is not enough."""
        need = self.config.learner.groups_per_batch // self.processes  # this process's share
        carried, self._carry = self._carry, []
        entries = [e for e in carried if self._admit(e, version)]  # gated again: a later version
        while len(entries) < need:
            try:
                entry = self._queue.get(timeout=0.05) if block else self._queue.get_nowait()
            except queue.Empty:
                if not block:
                    self._carry = entries
                    return None
                if self.stop.is_set():
                    self._carry = entries
                    return None
                held = len(self._unacked) + len(entries) + self._queue.qsize()
                if self._unacked and held >= self.config.buffer.max_pending:
                    # The buffer hands out nothing more until these are acknowledged.
                    if self.peers is not None and self._periodic:  # a collective: put to vote
                        self._wants_checkpoint = True
                        self._carry = entries
                        return None
                    self._acknowledge(early=True)
                continue
            if self._admit(entry, version):
                entries.append(entry)
        return entries

    # --- training ------------------------------------------------------------------------------

    def run(self) -> None:
        """Trains until `stop` is set or `run.max_steps` is reached (blocking)."""
        reader = threading.Thread(target=self._read, name="learner-reader", daemon=True)
        reader.start()
        finished = False
        try:
            self._loop()
            finished = True
        finally:
            try:
                self._reader_stop.set()  # the loop is over: read no more
                reader.join(timeout=5)
                if self._since_publish:
                    self.version += 1
                    self.publish()
                if finished:
                    self._checkpoint()  # the final one; then everything handled is acknowledged
                elif self.checkpointer is None:
                    self._flush_acks()
            finally:
                try:
                    self.wait_published()  # the last version is in the store before we end
                finally:
                    self._writer.shutdown(wait=False)
                    self.tracer.close()
                    self._waiter.shutdown(wait=False)
                    self.done.set()

    def _loop(self) -> None:
        """One learner step per iteration. While the device trains step k, the host gathers and
        builds step k+1's batch from what is already queued (gated at the version k+1 will be
        trained at: one more when step k publishes), so batch building leaves the critical path.

        Several processes: every collective (the vote, the batch's shape agreement, the step,
        publishing, checkpoints) runs in the same order on every process, so a batch gathered
        ahead is built at the next step's start, after the vote."""
        run, lc = self.config.run, self.config.learner
        ahead = None  # (entries, batch or None) of the next step, gathered while one trained
        finished = None  # when the last step completed (perf_counter)
        while self.peers is not None or not self.stop.is_set():
            if run.max_steps and self.step >= run.max_steps:
                return
            if ahead is None:
                wait_start = time.perf_counter()
                entries, batch = self._gather(self.version), None
                waited = time.perf_counter() - wait_start
            else:
                (entries, batch), ahead, waited = ahead, None, 0.0
            decision = self._decide(entries)
            if decision != "train":
                self._carry = (entries or []) + self._carry
                if decision == "stop":
                    return
                self._checkpoint()  # early: handled entries fill what the buffer may hand out
                continue
            self.metrics.observe("learner/wait_data_s", waited)
            built_s = 0.0
            if batch is None:
                batch, built_s = self._build(entries)
            self._record_staleness(entries)  # lag against self.version: the train version
            started, compiled = time.time(), compiles.compiles("train_step")
            start, cpu_start = time.perf_counter(), time.process_time()
            if finished is not None:  # host time between steps a fed learner also spends
                self.metrics.observe("learner/between_steps_s",
                                     max(0.0, start - finished - waited - built_s))
            # One call per microbatch, dispatched without waiting; `batch.updates` updates.
            self.state, step_metrics = self._train_step(self.state, batch)
            # Deliberate sync, on the waiter thread: the step is timed to its completion and its
            # metrics come to the host, while this thread builds the next batch.
            done = self._waiter.submit(_wait, step_metrics)
            if not run.max_steps or self.step + 1 < run.max_steps:
                next_version = self.version + (self._since_publish + 1) // lc.publish_every
                upcoming = self._gather(next_version, block=False)
                if upcoming is not None:
                    ahead = upcoming, self._build(upcoming)[0] if self.peers is None else None
            step_metrics, finished = done.result()
            compiled = compiles.compiles("train_step") != compiled
            self._finish_step(step_metrics, finished - start, start, cpu_start, batch, compiled)
            self.tracer.trained(entries, started, time.time(), self.version, self.step,
                                compiled=compiled)
            self.trained_ids.update(e.id for e in entries)
            self._handled("trained", entries)
            self._since_publish += 1
            if self._since_publish >= lc.publish_every:
                self.version += 1
                self.publish()
            self._report_state()
            self.tracer.poll()
            if not run.checkpoint_every or self.step % run.checkpoint_every == 0:
                self._acknowledge()
        if ahead is not None:  # stopping: built but not trained; gated again if ever used
            self._carry = ahead[0] + self._carry

    def _decide(self, entries: list[Entry] | None) -> str:
        """What to do with a gathered batch: "train", "stop" or "checkpoint". One process stops
        when `_gather` found nothing (stopping); several decide together, by vote."""
        if self.peers is None:
            return "train" if entries is not None else "stop"
        stopping, checkpoint = self.peers.vote(self.stop.is_set(), self._wants_checkpoint)
        self._wants_checkpoint = False
        if stopping:
            return "stop"
        if checkpoint:
            log.info("checkpointing early: handled entries wait for acknowledgement")
            return "checkpoint"
        return "train"

    def _build(self, entries: list[Entry]):
        """The batch of `entries` and the seconds building it took (`learner/batch_s`)."""
        start = time.perf_counter()
        batch = self.batcher.build([e.group for e in entries])
        seconds = time.perf_counter() - start
        self.metrics.observe("learner/batch_s", seconds)
        return batch, seconds

    def _finish_step(self, step_metrics: dict, elapsed: float, start: float, cpu_start: float,
                     batch, compiled: bool) -> None:
        """Records a completed step (`elapsed`: dispatch to completion; `start`, `cpu_start`:
        the clock and the process's CPU time at dispatch; `compiled`: a new shape was compiled
        during it)."""
        if self._first_step_at is None:
            self._first_step_at, self._cpu_at_first = start, cpu_start
        self.step += 1
        # A step that compiled is warm-up, not steady state: it is left out of utilisation and
        # of the rates (its time is `learner/compile_s`), and its CPU out of `learner/cpu_frac`.
        if compiled:
            self._compile_s += elapsed
            self._compile_cpu_s += time.process_time() - cpu_start
            self._compiled_steps += 1
        else:
            self._busy_s += elapsed
            self._tokens += batch.real_tokens
        window = max(time.perf_counter() - self._first_step_at - self._compile_s, 1e-9)
        m = self.metrics
        m.observe("learner/step_s", elapsed)
        m.gauge("learner/utilization", self.utilization)
        m.gauge("learner/compile_s", self._compile_s)
        m.gauge("learner/tokens_per_s", self._tokens / window)
        m.gauge("learner/steps_per_s", (self.step - self._compiled_steps) / window)
        # The process's CPU over the same window: with the steps per second, what a step costs
        # its cores all told (the audit's consume rate).
        m.gauge("learner/cpu_frac",
                (time.process_time() - self._cpu_at_first - self._compile_cpu_s) / window)
        m.gauge("learner/step", self.step)
        m.gauge("learner/version", self.version)
        m.gauge("learner/compiles", compiles.compiles("train_step"))
        # each trajectory is in one minibatch of each epoch
        m.gauge("learner/updates_per_trajectory", float(self.config.learner.epochs))
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

    # --- checkpoints and acknowledgement --------------------------------------------------------

    def _handled(self, kind: str, entries: list[Entry], reason: str | None = None) -> None:
        """Notes entries trained, dropped or skipped: acknowledged after the next checkpoint."""
        self._unacked.extend(e.id for e in entries)
        if self.ledger is not None:
            self.ledger.record(kind, entries, self.step, reason)

    @property
    def _periodic(self) -> bool:
        """Whether entries wait for a periodic checkpoint before they are acknowledged."""
        return self.checkpointer is not None and bool(self.config.run.checkpoint_every)

    def _acknowledge(self, early: bool = False) -> None:
        """Acknowledges after a checkpoint when checkpoints are periodic, else right away."""
        if self._periodic:
            if early:
                log.info("checkpointing early: %d handled entries wait for acknowledgement",
                         len(self._unacked))
            self._checkpoint()
        else:
            self._flush_acks()

    def _checkpoint(self) -> None:
        """Saves the state and bookkeeping (blocking), then acknowledges what it covers.

        A no-op when nothing happened since the last checkpoint. Without a checkpointer it only
        acknowledges. The key is the learner step, or one past the previous key when no step
        happened since (a checkpoint that covers only dropped or skipped entries).
        """
        if self.checkpointer is None:
            self._flush_acks()
            return
        if self._checkpoint_key is not None and self.step == self._checkpoint_step:
            (handled,) = (bool(self._unacked),) if self.peers is None else \
                self.peers.vote(bool(self._unacked))  # every process saves, or none
            if not handled:
                return
        start = time.perf_counter()
        key = self.step
        if self._checkpoint_key is not None:
            key = max(key, self._checkpoint_key + 1)
        if self.ledger is not None:
            self.ledger.mark(key, self.step)  # durable before anything it covers is acknowledged
        counters = self.metrics.export()["counters"]
        metadata = {"learner_step": self.step, "weights_version": self.version,
                    "since_publish": self._since_publish, "unacked": list(self._unacked),
                    "counters": counters, "time": time.time()}
        if self.peers is not None:  # process 0 writes the metadata: every process's part in it
            hosts = self.peers.gather_json({"unacked": metadata["unacked"],
                                            "counters": counters})
            metadata["hosts"] = hosts
            metadata["unacked"] = [i for host in hosts for i in host["unacked"]]
            metadata["counters"] = dict(sum((collections.Counter(h["counters"]) for h in hosts),
                                            collections.Counter()))
        # Every process joins (each writes its shards); blocks until complete on disk.
        self.checkpointer.save(key, self.state, metadata)
        self._checkpoint_key, self._checkpoint_step = key, self.step
        self._flush_acks()
        self.metrics.observe("learner/checkpoint_s", time.perf_counter() - start)

    def _restore(self) -> int | None:
        """Restores the latest checkpoint, if any, into this learner; returns its key."""
        key = self.checkpointer.latest_step()
        if key is None:
            return None
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)
        self.state, metadata = self.checkpointer.restore(abstract, key)
        self.step = int(metadata["learner_step"])
        self.version = int(metadata["weights_version"])
        self._since_publish = int(metadata["since_publish"])
        self.trained_ids = set(metadata["unacked"])  # every process's: skipped if redelivered
        hosts = metadata.get("hosts")
        if hosts is not None and len(hosts) == self.processes:
            counters = hosts[jax.process_index()]["counters"]
        else:  # written by another number of processes: process 0 carries the totals
            counters = metadata["counters"] if self.primary else {}
        for name, value in counters.items():
            self.metrics.count(name, value)
        self._checkpoint_key, self._checkpoint_step = key, self.step
        self.metrics.gauge("learner/step", self.step)
        self.metrics.gauge("learner/version", self.version)
        log.warning("restored checkpoint %d: learner step %d, version %d; %d entries it covers "
                    "are skipped if redelivered", key, self.step, self.version,
                    len(self.trained_ids))
        return key

    def _flush_acks(self) -> None:
        if self._unacked:
            ids, self._unacked = self._unacked, []
            # Admission hears first that these are no longer handled: until the ack lands it
            # counts them as queued, which errs on the safe side.
            self._report_state()
            self.buffer.ack(ids)
            self.trained_ids.difference_update(ids)

    @property
    def utilization(self) -> float:
        """Busy share of the time since the first step began, steps that compiled left out of
        both (a compile is warm-up: the time it took is `learner/compile_s`)."""
        if self._first_step_at is None:
            return 0.0
        window = time.perf_counter() - self._first_step_at - self._compile_s
        return self._busy_s / max(window, 1e-9)
