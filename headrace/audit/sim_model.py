"""The discrete-event model of the pipeline behind `headrace simulate` (SimPy).

Everything runs inside one `simpy.Environment` (one thread, simulated seconds); nothing blocks for
real. The parts mirror DESIGN.md: the weight store's versions and each actor's pickup of them
(`WeightTracker`), admission control ("Admission"), the bounded buffer with backpressure ("Buffer
contract"), the learner's reader, staleness gate and train loop (`Pipeline`), and a `Trace` of raw
observations from which `headrace.audit.simulate.summarize` computes the report. The actor side
(how long a group takes) lives in `headrace.audit.sim_actors`.
"""

from __future__ import annotations

import functools
import itertools
import math
from array import array
from collections import deque

import numpy as np
import simpy

from headrace.audit.sim_actors import AggregatedGeneration, FineGeneration
from headrace.audit.sim_spec import BufferSpec, Dist, Sampler, SimSpec


class GroupRecord:
    """What the simulation tracks of one group between its admission and its train step."""

    __slots__ = ("oldest", "started", "put_version")

    def __init__(self, oldest: int, started: float):
        self.oldest = oldest  # oldest weights version that generated any of its tokens
        self.started = started  # admission time (its episodes start then)
        self.put_version = -1  # the learner's published version when it landed


class Trace:
    """Observations of one run, summed over the steady-state window as they happen.

    The window opens at the start of the first train step (`open_window`) and closes at the horizon
    (`close`, which opens it at 0 if the learner never trained). The few observations made before it
    opens are kept and clipped to it at `close`; everything after is summed at once, so memory stays
    small however many groups a run produces. `headrace.audit.simulate.summarize` makes the report.
    """

    def __init__(self, horizon: float):
        self.horizon = horizon
        self.window_start: float | None = None
        self.depth_t = array("d", [0.0])  # buffer depth, piecewise constant from each time
        self.depth_v = array("q", [0])
        self.train_start: list[float] = []  # learner train steps (the end may pass the horizon)
        self.train_end: list[float] = []
        self.trained_lag = array("q")  # per trained group
        self.trained_lag_gen = array("q")
        self.trained_age = array("d")
        self.group_s = array("d")  # admission → last episode done, per group
        self.landed = 0  # groups put into the buffer, all run
        self.dropped = 0  # groups dropped by the staleness gate, all run
        self.landed_before = self.dropped_before = 0  # ... before the window opened
        self.busy_env_s = 0.0  # environment-slot seconds inside episodes, in the window
        self.wait_s = {"admission": 0.0, "put": 0.0}  # group-slot seconds waiting, in the window
        self.episodes_done = 0  # finished episodes and their summed durations, all run
        self.episode_s = 0.0
        self.inference_s = 0.0  # summed per-turn policy-call latency, all run
        self.inference_turns = 0
        self.publishes = 0
        self._early_episodes: list[tuple[float, list[float]]] = []
        self._early_waits: list[tuple[str, float, float]] = []

    def open_window(self, now: float) -> None:
        if self.window_start is None:
            self.window_start = now
            self.landed_before, self.dropped_before = self.landed, self.dropped

    def depth(self, now: float, depth: int) -> None:
        self.depth_t.append(now)
        self.depth_v.append(depth)

    def episodes(self, start: float, durations: list[float], finished: bool = True) -> None:
        """Episodes that started at `start` and ran `durations` (cut at the horizon)."""
        horizon = self.horizon
        if finished:
            for d in durations:
                if start + d <= horizon:
                    self.episodes_done += 1
                    self.episode_s += d
        if self.window_start is None:
            self._early_episodes.append((start, durations))
            return
        lo = max(start, self.window_start)
        for d in durations:
            self.busy_env_s += max(0.0, min(start + d, horizon) - lo)

    def whole_episodes(self, count: int, total_s: float) -> None:
        """`count` episodes that start now, inside the open window, and end before the horizon."""
        self.episodes_done += count
        self.episode_s += total_s
        self.busy_env_s += total_s

    def wait(self, kind: str, start: float, end: float) -> None:
        """A group slot waited (`admission` or `put`) from `start` to `end`."""
        if end <= start:
            return
        if self.window_start is None:
            self._early_waits.append((kind, start, end))
            return
        self.wait_s[kind] += max(0.0, min(end, self.horizon) - max(start, self.window_start))

    def close(self) -> None:
        self.open_window(0.0)
        early_episodes, self._early_episodes = self._early_episodes, []
        early_waits, self._early_waits = self._early_waits, []
        for start, durations in early_episodes:
            self.episodes(start, durations, finished=False)
        for kind, start, end in early_waits:
            self.wait(kind, start, end)


class WeightTracker:
    """Published versions and when each actor picks each one up, drawn once per publish.

    Version 0 is everyone's at time 0. A publish at `t` draws one pickup delay per actor (one numpy
    call); an actor samples, between turns, with the newest version whose pickup time has passed,
    so pickups need no events. Only the last `keep` versions' pickup times are kept: an actor still
    behind those is taken to hold the newest forgotten one (delays longer than `keep` publishes are
    not modelled).
    """

    def __init__(self, n_actors: int, pickup: Dist, rng: np.random.Generator, keep: int = 256):
        self.latest = 0
        self._n = n_actors
        self._pickup = pickup
        self._rng = rng
        self._keep = keep
        self._ready: dict[int, np.ndarray] = {}  # version -> pickup time per actor
        self.known = np.zeros(n_actors, dtype=np.int64)  # version each actor was last seen to hold

    def publish(self, now: float) -> None:
        self.latest += 1
        self._ready[self.latest] = now + self._pickup.sample(self._rng, self._n)
        self._ready.pop(self.latest - self._keep, None)

    def version(self, actor: int, now: float) -> int:
        """The version `actor` samples with at `now` (monotone in `now`)."""
        known = int(self.known[actor])
        for v in range(self.latest, known, -1):
            ready = self._ready.get(v)
            if ready is None or ready[actor] <= now:
                self.known[actor] = v
                return v
        return known

    def versions(self, now: float) -> np.ndarray:
        """Every actor's version at `now` (a view; do not modify). O(actors) per version behind."""
        oldest_kept = max(1, self.latest - self._keep + 1)
        lowest = int(self.known.min())
        if lowest < oldest_kept - 1:
            np.maximum(self.known, oldest_kept - 1, out=self.known)
        for v in range(max(lowest + 1, oldest_kept), self.latest + 1):
            picked = self._ready[v] <= now
            self.known[picked & (self.known < v)] = v
        return self.known

    def reach_time(self, actors: np.ndarray, version: int) -> float:
        """The earliest time one of `actors` holds `version` or newer (inf if never)."""
        times = [self._ready[v][actors].min() for v in range(version, self.latest + 1)
                 if v in self._ready]
        return float(min(times)) if times else math.inf


class Admission:
    """DESIGN.md "Admission": a slot starts a group only if it would be trained within the lag.

    `ahead` counts the groups admitted and not yet trained or dropped (in flight, put-blocked,
    buffered, read, training). With `k` learner steps done, a new group is forecast to be trained at
    version `(k + ceil((ahead + 1) / groups_per_batch) - 1) // publish_every`, which is DESIGN.md's
    `v + floor((s + ceil(Q / groups_per_batch) - 1) / publish_every)`; its actor may start it if its
    weights version is at least that minus `max_policy_lag`. Waiting slots are served oldest request
    first among the actors whose weights allow it, whenever the forecast can have changed (a step
    done, a drop, a publish) or an actor picks up weights that would let it start (one timer).
    With `admission: false` every request is granted at once. Cost: O(actors) numpy work per grant
    while slots wait, nothing per idle actor.
    """

    def __init__(self, env: simpy.Environment, spec: SimSpec, weights: WeightTracker):
        self.env = env
        self.enabled = spec.staleness.admission
        self.limit = spec.staleness.max_policy_lag
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
        batches = -(-queued // self.per_batch)
        return (self.steps_done + batches - 1) // self.publish_every

    def _need(self) -> int:
        """The oldest weights version that may start a group now."""
        if not self.enabled:
            return -1
        return self.forecast(self.ahead + 1) - self.limit

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

    def step_done(self, trained: int) -> None:
        self.steps_done += 1
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
    landed, unread groups (what DESIGN.md's capacity bounds).
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
            self.admission.step_done(len(batch))
            self._tokens.put(1)
            if (k + 1) % learner.publish_every == 0:
                delay = publish_s()
                if delay > 0:
                    yield env.timeout(delay)
                self.weights.publish(env.now)
                trace.publishes += 1
                self.admission.pump()
