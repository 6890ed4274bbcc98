"""The learner loop: feed -> train step -> book -> publish -> checkpoint.

    for entries, batch in feed:
        with clock.step():
            state, m = train_step(state, batch)
        book.trained(entries); publish if due; checkpoint if due

Its parts each live in their own module: the feed (`learner.feed`: reader thread, staleness gate,
carry, look-ahead), the acknowledgement book (`learner.book`: held, handled, unacknowledged and
trained ids, checkpoints, ledger: the only place persistence happens), the step clock
(`learner.clock`: device time, utilisation, compile time, CPU share) and the weights publisher
(`learner.publish`).

Versions. Version `v` are the weights after the `v * publish_every`-th step; a batch is trained at
the current version, which is what the gate measures lag against. While the device runs step k,
the training thread gathers and builds step k+1's batch from what is already queued, gated at the
version step k+1 will be trained at (known in advance: one more when step k publishes).

Checkpoints and acknowledgement (docs/design.md, "Buffer contract"; details in `learner.book`). With a
checkpointer and `run.checkpoint_every` > 0 the learner saves every `checkpoint_every` steps and
only then acknowledges the entries handled (trained, dropped, skipped); after a crash the restarted
learner restores the latest checkpoint: entries trained after it come back and are trained again,
those it covers are skipped (`buffer/redelivered_skipped`), never trained twice. When every
pending entry the buffer allows is handled but unacknowledged (dropped ones pile up), the learner
checkpoints early rather than wait for data that cannot come. Without a checkpointer, or with
`checkpoint_every` = 0, entries are acknowledged right after their step (a crash then loses them);
a checkpointer still saves at the end.

Redelivery never trains a group twice: an entry redelivered while this learner still holds it is
discarded on arrival (`buffer/redelivered_held`); one its checkpoint covers is skipped; and the
processes of one learner never claim each other's entries (`Buffer.share_with`).

Bad data (docs/design.md, "Invariants"). The feed quarantines, through the buffer, a group whose token
ids reach past the model's vocabulary. An update whose loss or gradient norm is not finite is
skipped inside the train step and counted (`learner/skipped_nonfinite`);
`learner.max_nonfinite_steps` consecutive such steps end the run with `NonFiniteSteps`, the
weights as they were before them.

Several processes (`parallel.processes`): every collective (the vote, the batch's shape
agreement, the step, publishing, checkpoints) runs in the same order on every process; each
iteration starts with a vote (stop, checkpoint early, or train), and a batch gathered ahead is
built after it.

Stopping: `stop` ends the loop and the reader; the learner publishes its last weights and, when
it stopped cleanly, saves a final checkpoint and acknowledges everything it handled. After an
error nothing more is acknowledged (the entries come back to a resumed learner).

LoRA (`model.lora.rank` > 0): the model's weights are frozen, handed to the step as its fixed base
(`TrainStep.freeze`, compute dtype); the state's params, optimizer state, checkpoints, published
versions and `learner/param_norm` are the adapters' alone (A random, B zero: version 0 is the base).
A resumed run rebuilds the base from its config (`model.init_from`, or the seed) as a fresh one does.

Failures: `run` raises `LearnerError` when any of its threads failed: the reader (it sets `stop`
and leaves its error, so the run never reads as a clean stop), batch building, or the weights
publisher (its error surfaces at the next publish or at the end). The message names the part that
failed; the launchers report it in `summary.json`'s `errors` and exit non-zero.
"""

from __future__ import annotations

import logging
import pathlib
import threading
import time
from collections.abc import Iterator

import jax
import numpy as np

from headrace.buffer.admission import Admission
from headrace.buffer.base import Buffer
from headrace.config import Config
from headrace.learner import train_step as step_lib
from headrace.learner.batching import Batch, Batcher
from headrace.learner.book import Book, Position
from headrace.learner.clock import StepClock
from headrace.learner.feed import STARVED, Feed, LearnerError
from headrace.learner.gate import StalenessGate
from headrace.learner.publish import Publisher
from headrace.learner.sharded_step import ShardedTrainStep, learner_step
from headrace.learner.train_step import SKIPPED, NonFiniteSteps, init_state, make_optimizer
from headrace.metrics.core import Metrics
from headrace.metrics.traces import Tracer
from headrace.model import lora as lora_lib
from headrace.model import params as params_lib
from headrace.parallel import multihost
from headrace.types import Entry
from headrace.versions import trained_at
from headrace.weights.base import WeightStore

__all__ = ["Learner", "LearnerError"]

log = logging.getLogger(__name__)


class Learner:
    def __init__(self, config: Config, graphdef, params, buffer: Buffer, weights: WeightStore,
                 metrics: Metrics, stop: threading.Event, allowed_v: np.ndarray | None = None,
                 admission: Admission | None = None, checkpointer=None, ledger=None,
                 trace_path: pathlib.Path | None = None, pins: WeightStore | None = None):
        """Builds the learner; with a `checkpointer` holding a checkpoint, restores the latest.

        Args:
          checkpointer: saves and restores checkpoints (`headrace.learner.checkpoint.Checkpointer`
            or the same methods: save, restore, latest_step); None: no checkpoints.
          ledger: records what is done with each entry (`headrace.runtime.resume.Ledger`: begin,
            record, mark); None: no ledger.
          trace_path: where traced groups are written (traces.jsonl); None: stage metrics only.
          pins: where the weights of every step that is a multiple of `run.eval_every` (before
            `run.max_steps`) are written, keyed by the step, for the periodic evaluation; None:
            no pins.

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
        primary = jax.process_index() == 0
        trainable = params
        if self._train_step.lora is not None:  # the base is frozen; the adapters are trained
            dims = params_lib.merge(graphdef, params).dims
            self._train_step.freeze(step_lib.compute_params(params, dims))
            trainable = lora_lib.init(params, self._train_step.lora, config.run.seed + 1)
        self.state = init_state(trainable, optimizer, lc.kl_coef, lc.master_dtype)
        if self.processes > 1:  # before the first collective (see multihost.CompiledTogether)
            multihost.barrier("headrace-learner-built", multihost.COMPILE_BARRIER_S)
        if isinstance(self._train_step, ShardedTrainStep):
            self.state = self._train_step.place(self.state)
        self.peers = multihost.Peers() if self.processes > 1 else None
        if self.peers is not None:  # a collective: every process names its consumer
            buffer.share_with(self.peers.gather_json(getattr(buffer, "consumer", "")))
        dims = params_lib.merge(graphdef, params).dims
        self.batcher = Batcher(lc, config.shapes, metrics, row_multiple=row_multiple,
                               peers=self.peers)
        self.step = 0
        self.version = 0
        self._since_publish = 0
        self._nonfinite_steps = 0  # consecutive steps with a skipped non-finite update
        self.done = threading.Event()
        self.tracer = Tracer(trace_path, weights, metrics)
        self.book = Book(config, buffer, metrics, checkpointer, ledger, self.peers,
                         report=self._report_state)
        self.feed = Feed(config, buffer, self.batcher, StalenessGate(config.staleness, metrics),
                         self.book, metrics, self.tracer, stop, dims.vocab_size, self.processes,
                         report=self._report_state)
        self.clock = StepClock(metrics)
        self.publisher = Publisher(weights, pins, metrics, self.tracer, dims, self.processes,
                                   primary)
        self.state, restored = self.book.open(self.state)
        if restored is not None:
            self.step, self.version, self._since_publish = restored
            metrics.gauge("learner/step", self.step)
            metrics.gauge("learner/version", self.version)

    # --- weights -------------------------------------------------------------------------------

    def publish(self, wait: bool = False) -> None:
        """Publishes the current weights as `self.version` (`learner.publish.Publisher`); `wait`:
        return once the store holds it."""
        self.publisher.publish(self.state.params, self.version)  # raises a failed write
        self._since_publish = 0
        if wait:
            self.publisher.wait()

    def wait_published(self) -> None:
        """Blocks until the last publish is in the store (re-raising its error)."""
        self.publisher.wait()

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

    def _pin(self) -> None:
        """Pins the weights of this step when it is an evaluation point (every `run.eval_every`
        steps, the last step left to the final evaluation)."""
        run = self.config.run
        if (run.eval_every and not self.step % run.eval_every
                and not (run.max_steps and self.step >= run.max_steps)):
            self.publisher.pin(self.state.params, self.step)

    def _report_state(self) -> None:
        """Tells admission control where the learner is: version, steps since publish, the
        entries handled but not yet acknowledged (admission counts the rest of the buffer's
        pending entries as this learner's queue) and those the feed is blocked waiting for. Only
        the training thread reports, so reports stay in order."""
        if self.admission is not None:  # each learner process reports its own
            step_s = self.metrics.distribution("learner/step_s")
            self.admission.learner_update(self.version, self._since_publish,
                                          len(self.book.unacked),
                                          step_s.mean() if step_s is not None else 0.0,
                                          host=str(jax.process_index()),
                                          waiting_for=self.feed.waiting_for)

    @property
    def position(self) -> Position:
        return Position(self.step, self.version, self._since_publish)

    @property
    def restored_from(self) -> int | None:
        """The key of the checkpoint this learner restored, or None (a fresh run)."""
        return self.book.restored_from

    # --- training ------------------------------------------------------------------------------

    def run(self) -> None:
        """Trains until `stop` is set or `run.max_steps` is reached (blocking)."""
        self.feed.start()
        finished = False
        try:
            if self.config.learner.precompile:
                self._precompile()
            self._loop()
            if self.feed.error is not None:  # a failure, not a stop: nothing more is acked
                error = self.feed.error
                raise LearnerError(f"the reader thread failed: {type(error).__name__}: "
                                   f"{error}") from error
            finished = True
        finally:
            try:
                self.feed.close()  # the loop is over: read no more
                if self._since_publish:
                    self.version += 1
                    self.publish()
                if finished:  # the final checkpoint; then everything handled is acknowledged
                    self.book.checkpoint(self.state, self.position)
                elif self.book.checkpointer is None:
                    self.book.flush()
            finally:
                try:
                    self.wait_published()  # the last version is in the store before we end
                finally:
                    self.publisher.close()
                    self.tracer.close()
                    self.clock.close()
                    self.done.set()

    def _precompile(self) -> None:
        """`learner.precompile`: the program of every microbatch shape the batcher can make,
        compiled while the feed gathers the first batch and the actors start, so no step
        compiles. Several processes meet at a barrier after it (as after building their state):
        each enters the loop, and its first collective, with its programs ready."""
        start, shapes = time.perf_counter(), self.batcher.policy.shapes()
        self._train_step.precompile(self.state, shapes)
        if self.processes > 1:
            multihost.barrier("headrace-learner-precompiled", multihost.COMPILE_BARRIER_S)
        elapsed = time.perf_counter() - start
        self.metrics.gauge("learner/precompile_s", elapsed)
        log.info("learner: the train step compiled for %d shapes in %.1f s, before the first "
                 "batch", len(shapes), elapsed)

    def _loop(self) -> None:
        """One learner step per batch the feed gives; the next batch is gathered (and, one
        process, built) while the device trains this one."""
        for entries, batch in self._batches():
            with self.clock.step(batch.real_tokens, self.feed.host_s) as timing:
                # One call per microbatch, dispatched without waiting; `batch.updates` updates.
                self.state, step_metrics = self._train_step(self.state, batch)
                timing.wait_for(step_metrics)  # timed to completion on the waiter thread...
                self._look_ahead()  # ...while this thread gathers and builds the next batch
            self._finish_step(timing.metrics)
            self.tracer.trained(entries, timing.began, time.time(), self.version, self.step,
                                compiled=timing.compiled)
            self.book.trained(entries, self.step)
            self._publish_if_due()
            if self.book.due(self.step):
                self.book.acknowledge(self.state, self.position)
            else:
                self.book.settle()  # a checkpoint written in the background: acked once complete
        self.feed.put_back(None)  # stopping: gathered ahead, not trained; gated again if used

    def _look_ahead(self) -> None:
        """The next step's batch, gated at the version it will be trained at (one more when
        this step publishes), unless this is the last step."""
        if self._more_steps(1):
            self.feed.look_ahead(trained_at(self.version, self._since_publish, 2,
                                            self.config.learner.publish_every))

    def _publish_if_due(self) -> None:
        """After a step: publishes every `publish_every` steps, pins evaluation points, and
        tells admission control where the learner is."""
        self._since_publish += 1
        if self._since_publish >= self.config.learner.publish_every:
            self.version += 1
            self.publish()
        self._pin()
        self._report_state()
        self.tracer.poll()

    def _more_steps(self, after: int = 0) -> bool:
        """Whether `run.max_steps` allows a step `after` steps from now."""
        max_steps = self.config.run.max_steps
        return not max_steps or self.step + after < max_steps

    def _batches(self) -> Iterator[tuple[list[Entry], Batch]]:
        """The batches to train, each with its entries, until stopping or `run.max_steps`.
        Several processes decide each one together (`_decide`)."""
        while (self.peers is not None or not self.stop.is_set()) and self._more_steps():
            got = self._next()
            decision = self._decide(got)
            if decision != "train":
                self.feed.put_back(got)
                if decision == "stop":
                    return
                self.book.checkpoint(self.state, self.position)  # early: see `_next`
                continue
            entries, batch = got
            self.metrics.observe("learner/wait_data_s", self.feed.waited_s)
            batch = batch if batch is not None else self.feed.build(entries)
            self._record_staleness(entries)  # lag against self.version: the train version
            yield entries, batch

    def _next(self):
        """The feed's next (entries, batch or None), None once stopping, or `STARVED` where only
        a vote may relieve it (several processes, periodic checkpoints). Otherwise a starved feed
        (handled entries fill what the buffer may hand out) is relieved here: a checkpoint early,
        or the acknowledgement without one."""
        while True:
            got = self.feed.next(self.version)
            if got is not STARVED or (self.peers is not None and self.book.periodic):
                return got
            self.book.acknowledge(self.state, self.position, early=True)

    def _decide(self, got) -> str:
        """What to do with what the feed gave: "train", "stop" or "checkpoint". One process stops
        when the feed gave nothing (stopping); several decide together, by vote."""
        if self.peers is None:
            return "train" if isinstance(got, tuple) else "stop"
        stopping, checkpoint = self.peers.vote(self.stop.is_set(), got is STARVED)
        if stopping:
            return "stop"
        if checkpoint:
            log.info("checkpointing early: handled entries wait for acknowledgement")
            return "checkpoint"
        return "train"

    def _finish_step(self, step_metrics: dict) -> None:
        """Records a completed step's metrics (on the host); ends the run after too many
        consecutive non-finite updates."""
        self.step += 1
        m = self.metrics
        m.gauge("learner/step", self.step)
        m.gauge("learner/version", self.version)
        # each trajectory is in one minibatch of each epoch
        m.gauge("learner/updates_per_trajectory", float(self.config.learner.epochs))
        skipped = int(step_metrics.pop(SKIPPED, 0))
        for name, value in step_metrics.items():
            m.gauge(name, float(value))
        if skipped:
            m.count(SKIPPED, skipped)
        self._nonfinite_steps = self._nonfinite_steps + 1 if skipped else 0
        limit = self.config.learner.max_nonfinite_steps
        if limit and self._nonfinite_steps >= limit:
            raise NonFiniteSteps(
                f"{self._nonfinite_steps} consecutive learner steps (up to step {self.step}) had "
                f"a non-finite loss or gradient norm (learner.max_nonfinite_steps={limit}); their "
                "updates were skipped, so the weights are those before them. Look at the data "
                "(reward scale, behaviour log-probs) or lower learner.optimizer.lr; "
                "learner.max_nonfinite_steps=0 never stops")

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
        # Per generated token (each stamped with the version that made it): where weights are
        # refreshed between turns, a group's later turns are newer than its oldest token.
        made = np.concatenate([t.policy_version[t.loss_mask] for g in groups
                               for t in g.trajectories] or [np.zeros(0, np.int32)])
        made = made[made >= 0]
        if made.size:
            m.gauge("staleness/token_lag_mean", float(self.version - made.mean()))
        m.observe_many("staleness/age_s", [now - g.started for g in groups])
        m.count("learner/groups", len(groups))
        m.count("learner/trajectories", sum(len(g.trajectories) for g in groups))
        # this step's own reward (reward/mean is the actors' mean over their last 4,096 episodes)
        m.gauge("learner/reward_mean",
                float(np.mean([t.reward for g in groups for t in g.trajectories])))
        m.count("buffer/redelivered_trained", sum(e.delivery_count > 1 for e in entries))

    @property
    def utilization(self) -> float:
        """Busy share of the time since the first step began (`StepClock.utilization`)."""
        return self.clock.utilization
