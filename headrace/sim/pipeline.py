"""The discrete-event model of the pipeline behind `headrace simulate` (SimPy).

Everything runs inside one `simpy.Environment` (one thread, simulated seconds); nothing blocks for
real. The parts mirror docs/design.md: admission control ("Admission"), the bounded buffer with
backpressure ("Buffer contract"), the learner's reader, staleness gate and train loop (`Pipeline`).
The weight store's versions and each actor's pickup of them (`WeightTracker`) and the `Trace` of
raw observations, from which `headrace.sim.simulate.summarize` computes the report, live in
`headrace.sim.trace`; the actor side (how long a group takes) in `headrace.sim.actors`.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import deque

import numpy as np
import simpy

from headrace.sim.actors import AggregatedGeneration, FineGeneration
from headrace.sim.spec import BufferSpec, Sampler, SimSpec
from headrace.sim.trace import GroupRecord, Trace, WeightTracker
from headrace.versions import batches_for, too_many_ready, trained_at_version


class Admission:
    """Admission (docs/design.md): a slot starts a group only if it would be trained within the lag.

    `ahead` counts the groups admitted and not yet trained or dropped (in flight, put-blocked,
    buffered, read, training). With `k` learner steps done, a new group is forecast to be trained at
    version `(k + ceil((ahead + 1) / groups_per_batch) - 1) // publish_every`, which is admission's
    `v + floor((s + ceil(Q / groups_per_batch) - 1) / publish_every)`; its actor may start it if its
    weights version is at least that minus `max_policy_lag`. Waiting slots are served oldest request
    first among the actors whose weights allow it, whenever the forecast can have changed (a step
    done, a drop, a publish) or an actor picks up weights that would let it start (one timer).
    With `max_ready_batches` it also applies the ready cap (`versions.too_many_ready`) with the
    p90 of the last 4,096 groups' durations (the actors' episodes run in a group together;
    recomputed at most once a simulated second, once 8 are known) and the mean learner step so
    far. With `admission: false` every request is granted at once. Cost: O(actors) numpy work per
    grant while slots wait, nothing per idle actor.
    """

    def __init__(self, env: simpy.Environment, spec: SimSpec, weights: WeightTracker):
        self.env = env
        self.enabled = spec.staleness.admission
        self.limit = spec.staleness.max_policy_lag
        self.max_ready = spec.staleness.max_ready_batches
        self._group_s: deque[float] = deque(maxlen=4096)
        self._p90, self._p90_at = None, -math.inf
        self._step_total = 0.0
        self.per_batch = spec.learner.groups_per_batch
        self.publish_every = spec.learner.publish_every
        self.weights = weights
        self.ahead = 0
        self.steps_done = 0
        n = spec.actors.count
        self._queues: list[deque] = [deque() for _ in range(n)]  # per actor: (order, slot)
        self._head = np.full(n, np.inf)  # request order of each actor's oldest waiting slot
        self._waiting = 0
        self._order = itertools.count()
        self._wake = math.inf

    def forecast(self, queued: int) -> int:
        """Version a group with `queued` groups ahead of it (itself included) is trained at."""
        return trained_at_version(0, self.steps_done, queued, self.per_batch, self.publish_every)

    def _need(self) -> float:
        """The oldest weights version that may start a group now (inf: none may, the ready cap
        refuses until a step is done)."""
        if not self.enabled:
            return -1
        if self.max_ready and too_many_ready(
                batches_for(self.ahead + 1, self.per_batch),
                self._step_total / self.steps_done if self.steps_done else 0.0, self._p90_s(),
                self.max_ready):
            return math.inf  # only with the cap on: `_need` runs for every grant
        return self.forecast(self.ahead + 1) - self.limit

    def _p90_s(self) -> float | None:
        now = self.env.now
        if now - self._p90_at >= 1.0 and len(self._group_s) >= 8:
            self._p90, self._p90_at = float(np.quantile(np.fromiter(self._group_s, float), 0.9)), now
        return self._p90

    def finished(self, group_s: float) -> None:
        """A group took `group_s` from its start to its last episode's end."""
        self._group_s.append(group_s)

    def request(self, slot) -> simpy.Event:
        """An event that succeeds with the actor's weights version once the slot is admitted."""
        slot.grant = self.env.event()
        actor = slot.actor
        if not self._waiting:
            need = self._need()
            if need <= self.weights.latest:
                version = self.weights.version(actor, self.env.now)
                if version >= need:
                    self.ahead += 1
                    return slot.grant.succeed(version)
        order = next(self._order)
        queue = self._queues[actor]
        if not queue:
            self._head[actor] = order
        queue.append((order, slot))
        self._waiting += 1
        self.pump()
        return slot.grant

    def step_done(self, trained: int, step_s: float) -> None:
        self.steps_done += 1
        self._step_total += step_s
        self.ahead -= trained
        self.pump()

    def dropped(self) -> None:
        self.ahead -= 1
        self.pump()

    def pump(self) -> None:
        """Admits waiting slots, oldest request first among actors allowed to start, while the
        forecast allows; otherwise sleeps until the next pickup that could change that."""
        now, versions = self.env.now, None
        while self._waiting:
            need = self._need()
            if need > self.weights.latest:
                return  # not even an actor with the newest weights may start
            if versions is None:
                versions = self.weights.versions(now)
            candidates = np.where(versions >= need, self._head, np.inf)
            actor = int(np.argmin(candidates))
            if not np.isfinite(candidates[actor]):
                waiting = np.flatnonzero(np.isfinite(self._head))
                self._sleep_until(self.weights.reach_time(waiting, need))
                return
            queue = self._queues[actor]
            _, slot = queue.popleft()
            self._head[actor] = queue[0][0] if queue else np.inf
            self._waiting -= 1
            self.ahead += 1
            slot.grant.succeed(int(versions[actor]))

    def _sleep_until(self, when: float) -> None:
        now = self.env.now
        if not math.isfinite(when) or (now < self._wake <= when):
            return
        self._wake = when
        self.env.timeout(when - now).callbacks.append(self._woken)

    def _woken(self, _event) -> None:
        if self._wake <= self.env.now:
            self._wake = math.inf
        self.pump()


class SimBuffer:
    """The bounded buffer: a put blocks while depth (plus puts in progress) >= capacity.

    Blocked puts are served in order as the learner's reads free room; `depth` is the number of
    landed, unread groups (what the buffer's capacity bounds).
    """

    def __init__(self, env: simpy.Environment, spec: BufferSpec, rng: np.random.Generator,
                 weights: WeightTracker, trace: Trace):
        self.env = env
        self.capacity = spec.capacity
        self.items: deque[GroupRecord] = deque()
        self._put_s = Sampler(spec.put_s, rng)
        self._weights = weights
        self._trace = trace
        self._putting = 0
        self._blocked: deque[tuple[GroupRecord, simpy.Event]] = deque()
        self._reader: simpy.Event | None = None

    def put(self, record: GroupRecord) -> simpy.Event:
        """An event that succeeds when `record` has landed (after any wait for room)."""
        done = self.env.event()
        if len(self.items) + self._putting < self.capacity:
            self._start(record, done)
        else:
            self._blocked.append((record, done))
        return done

    def wait(self) -> simpy.Event:
        """An event that succeeds when the buffer is no longer empty (one reader)."""
        self._reader = self.env.event()
        if self.items:
            self._reader.succeed()
        return self._reader

    def take(self, n: int) -> list[GroupRecord]:
        """Reads up to `n` groups in arrival order and lets blocked puts proceed."""
        out = [self.items.popleft() for _ in range(min(n, len(self.items)))]
        if out:
            self._trace.depth(self.env.now, len(self.items))
        while self._blocked and len(self.items) + self._putting < self.capacity:
            self._start(*self._blocked.popleft())
        return out

    def _start(self, record: GroupRecord, done: simpy.Event) -> None:
        delay = self._put_s()
        if delay <= 0:
            self._land(record, done)
            return
        self._putting += 1
        self.env.timeout(delay).callbacks.append(functools.partial(self._landed, record, done))

    def _landed(self, record: GroupRecord, done: simpy.Event, _event) -> None:
        self._putting -= 1
        self._land(record, done)

    def _land(self, record: GroupRecord, done: simpy.Event) -> None:
        now = self.env.now
        record.put_version = self._weights.latest
        self.items.append(record)
        self._trace.depth(now, len(self.items))
        self._trace.landed += 1
        done.succeed()
        if self._reader is not None and not self._reader.triggered:
            self._reader.succeed()


class Slot:
    """One group slot of an actor (group_size environments that run one group at a time)."""

    __slots__ = ("actor", "grant", "state", "since")

    def __init__(self, actor: int):
        self.actor = actor
        self.grant: simpy.Event | None = None
        self.state = "admission"  # admission | generating | put
        self.since = 0.0


class Pipeline:
    """One simulated run of the whole pipeline: `Pipeline(spec, seed).run()` returns its Trace.

    Processes: one per group slot (admission → generate → put), the learner's reader (buffer →
    staleness gate → batches of `groups_per_batch`, at most `prefetch` ahead of the one training)
    and the learner (train step, then a publish every `publish_every` steps). Batch `k` is trained
    at version `k // publish_every`; the gate drops a group whose lag at that version exceeds
    `max_policy_lag`. The run stops at `duration_s`; work in progress is left as it is.
    """

    def __init__(self, spec: SimSpec, seed: int = 0):
        self.spec = spec
        self.env = simpy.Environment()
        self.rng = np.random.default_rng(seed)
        self.trace = Trace(spec.duration_s)
        actors = spec.actors
        self.weights = WeightTracker(actors.count, actors.pickup_s, self.rng)
        self.admission = Admission(self.env, spec, self.weights)
        self.buffer = SimBuffer(self.env, spec.buffer, self.rng, self.weights, self.trace)
        if spec.model == "fine":
            self.generation = FineGeneration(self.env, actors, self.rng, self.trace, self.weights)
        else:
            self.generation = AggregatedGeneration(self.env, actors, self.rng, self.trace)
        self.slots = [Slot(a) for a in range(actors.count) for _ in range(actors.slots)]
        self._tokens = simpy.Container(self.env, init=spec.learner.prefetch + 1)
        self._batches = simpy.Store(self.env)

    def run(self) -> Trace:
        env = self.env
        for slot in self.slots:
            env.process(self._slot(slot))
        env.process(self._reader())
        env.process(self._learner())
        env.run(until=self.spec.duration_s)
        horizon, trace = self.spec.duration_s, self.trace
        for slot in self.slots:
            if slot.state in trace.wait_s:
                trace.wait(slot.state, slot.since, horizon)
        self.generation.finalize(horizon)
        trace.close()
        return trace

    def _slot(self, slot: Slot):
        env, trace = self.env, self.trace
        while True:
            slot.state, slot.since = "admission", env.now
            version = yield self.admission.request(slot)
            trace.wait("admission", slot.since, env.now)
            slot.state = "generating"
            oldest, started = yield from self.generation.generate(slot.actor, version)
            record = GroupRecord(oldest, started)
            trace.group_s.append(env.now - record.started)
            self.admission.finished(env.now - record.started)
            slot.state, slot.since = "put", env.now
            yield self.buffer.put(record)
            trace.wait("put", slot.since, env.now)

    def _reader(self):
        env, learner, trace = self.env, self.spec.learner, self.trace
        limit = self.spec.staleness.max_policy_lag
        get_s = Sampler(self.spec.buffer.get_s, self.rng)
        for k in itertools.count():
            yield self._tokens.get(1)
            version, batch = k // learner.publish_every, []
            while len(batch) < learner.groups_per_batch:
                if not self.buffer.items:
                    yield self.buffer.wait()
                delay = get_s()
                if delay > 0:
                    yield env.timeout(delay)
                for record in self.buffer.take(learner.groups_per_batch - len(batch)):
                    if version - record.oldest > limit:
                        trace.dropped += 1
                        self.admission.dropped()
                    else:
                        batch.append(record)
            self._batches.put((k, batch))

    def _learner(self):
        env, learner, trace = self.env, self.spec.learner, self.trace
        step_s = Sampler(learner.step_s, self.rng)
        publish_s = Sampler(learner.publish_s, self.rng)
        while True:
            k, batch = yield self._batches.get()
            start, duration = env.now, step_s()
            trace.open_window(start)
            trace.train_start.append(start)
            trace.train_end.append(start + duration)
            if duration > 0:
                yield env.timeout(duration)
            version, now = k // learner.publish_every, env.now
            for record in batch:
                trace.trained_lag.append(version - record.oldest)
                trace.trained_lag_gen.append(record.put_version - record.oldest)
                trace.trained_age.append(now - record.started)
            self.admission.step_done(len(batch), duration)
            self._tokens.put(1)
            if (k + 1) % learner.publish_every == 0:
                delay = publish_s()
                if delay > 0:
                    yield env.timeout(delay)
                self.weights.publish(env.now)
                trace.publishes += 1
                self.admission.pump()
