"""The actor side of the pipeline simulation: how long a group takes and which weights it used.

Two models of generation, behind one method `generate(actor, version)` (a SimPy sub-process that
returns `(oldest version, start time)` when the group's last episode is done):

- `FineGeneration`: every turn of every episode, a batched policy call on the actor's sampler
  (`ActorSampler`, continuous batching), then an environment step. Several events per turn.
- `AggregatedGeneration`: a group is one timeout; its G episode durations are drawn together with
  numpy, the policy call's latency per turn taken from the fine model of one actor
  (`calibrate_inference`). A few events per group, so fleets of 10,000 actors run in seconds.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import numpy as np
import simpy

from headrace.sim.spec import ActorSpec, InferenceSpec, Sampler
from headrace.sim.trace import Trace, WeightTracker


class ActorSampler:
    """One actor's batched policy calls (continuous batching).

    A call starts when the sampler is free and takes every episode waiting at that moment (up to
    `max_batch`; the rest wait for the next call); it lasts `fixed_s + per_row_s * rows`. An idle
    sampler first waits `wait_s` for company (with 0, still every episode asking at that instant).
    A call succeeds each of its episodes' events with the weights version it sampled with (read at
    the call's start).
    """

    def __init__(self, env: simpy.Environment, spec: InferenceSpec,
                 version: Callable[[float], int]):
        self.env = env
        self.spec = spec
        self._version = version
        self._waiting: list[tuple[simpy.Event, float]] = []
        self._busy = False
        self.latency_s = 0.0  # summed request → answer time
        self.answered = 0

    def call(self) -> simpy.Event:
        event = self.env.event()
        if self.spec.is_zero:
            self.answered += 1
            return event.succeed(self._version(self.env.now))
        self._waiting.append((event, self.env.now))
        if not self._busy:
            self._busy = True
            self.env.process(self._serve())
        return event

    def _serve(self):
        spec, env = self.spec, self.env
        # A zero wait still lets episodes that ask at this same instant join the first call.
        yield env.timeout(spec.wait_s)
        while self._waiting:
            batch = self._waiting[:spec.max_batch]
            del self._waiting[:spec.max_batch]
            version = self._version(env.now)
            duration = spec.fixed_s + spec.per_row_s * len(batch)
            if duration > 0:
                yield env.timeout(duration)
            now = env.now
            for event, asked in batch:
                self.latency_s += now - asked
                event.succeed(version)
            self.answered += len(batch)
        self._busy = False


def calibrate_inference(actors: ActorSpec, groups: int, rng: np.random.Generator,
                        requests: int = 3000) -> float:
    """Mean seconds an episode spends per turn in its policy call (queueing + call), for one actor
    generating `groups` groups at once, measured by running the fine model of that actor alone.

    The actor runs closed-loop (a slot starts its next group as soon as the last one is done), with
    random initial phases; the first fifth of the calls are discarded as warm-up.
    """
    if actors.inference.is_zero:
        return 0.0
    env = simpy.Environment()
    sampler = ActorSampler(env, actors.inference, lambda _now: 0)
    turns, steps = Sampler(actors.turns, rng), Sampler(actors.env_step_s, rng)
    phase = actors.turns.expected * actors.env_step_s.expected

    def episode():
        for _ in range(max(1, round(turns()))):
            yield sampler.call()
            step = steps()
            if step > 0:
                yield env.timeout(step)

    def slot():
        yield env.timeout(phase * rng.random())
        while True:
            yield simpy.AllOf(env, [env.process(episode()) for _ in range(actors.group_size)])

    for _ in range(groups):
        env.process(slot())
    warm = requests // 5
    while sampler.answered < warm:
        env.step()
    latency, answered = sampler.latency_s, sampler.answered
    while sampler.answered < warm + requests:
        env.step()
    return (sampler.latency_s - latency) / (sampler.answered - answered)


def load_bucket(groups: int) -> int:
    """The load a calibration stands for: exact up to 32 groups, then the nearest of 16 an octave
    (within 3.2 %). A calibration costs in proportion to its load, so an actor ramping to
    thousands of groups calibrates ~100 times, not thousands (quadratic)."""
    if groups <= 32:
        return groups
    step = 1 << (groups.bit_length() - 5)
    return round(groups / step) * step


class AggregatedGeneration:
    """A group is one timeout: its G episode durations are drawn together (numpy, 1,024 groups a
    call), each `sum of env steps + turns * inference latency`, and the group lasts the longest.

    The per-turn inference latency is the fine model's, measured once per bucket of the number of
    groups the actor generates at the moment (`load_bucket`, `calibrate_inference`); weights are
    read at the group's start, which is when the fine model's first policy call samples too.
    Lost: the spread of per-turn queueing around its mean, and changes of the actor's load during
    a group.
    """

    def __init__(self, env: simpy.Environment, actors: ActorSpec, rng: np.random.Generator,
                 trace: Trace, chunk: int = 1024):
        self.env = env
        self.actors = actors
        self.rng = rng
        self.trace = trace
        self._calibration_rng = rng.spawn(1)[0]
        self._active = [0] * actors.count
        self._latency: dict[int, float] = {}  # groups generating in the actor -> s per turn
        self._chunk = chunk
        self._next = chunk
        self._sums = self._turns = np.zeros((0, 0))
        self._turn_totals: list[int] = []
        self._rows: dict[int, tuple[np.ndarray, list[float], list[float], float]] = {}

    def _draw(self) -> None:
        """Draws the next `chunk` groups: per episode, its turns and summed env-step time."""
        actors, rng, n = self.actors, self.rng, self._chunk * self.actors.group_size
        turns = np.maximum(1, np.rint(actors.turns.sample(rng, n))).astype(np.int64)
        steps = actors.env_step_s.sample(rng, int(turns.sum()))
        starts = np.concatenate(([0], np.cumsum(turns)[:-1]))
        self._sums = np.add.reduceat(steps, starts).reshape(self._chunk, -1)
        self._turns = turns.reshape(self._chunk, -1)
        self._turn_totals = self._turns.sum(axis=1).tolist()
        self._rows = {}
        self._next = 0

    def _durations(self, load: int) -> tuple[np.ndarray, list[float], list[float], float]:
        """The chunk's episode durations, and per group the longest and the sum, at an actor load
        (one numpy call per chunk and load bucket)."""
        load = load_bucket(load)
        if load not in self._latency:
            self._latency[load] = calibrate_inference(self.actors, load, self._calibration_rng)
        if load not in self._rows:
            per_turn = self._latency[load]
            durations = self._sums + self._turns * per_turn
            self._rows[load] = (durations, durations.max(axis=1).tolist(),
                                durations.sum(axis=1).tolist(), per_turn)
        return self._rows[load]

    def generate(self, actor: int, version: int):
        """Runs one group; returns (oldest weights version used, start time)."""
        if self._next == self._chunk:
            self._draw()
        row = self._next
        self._next += 1
        self._active[actor] += 1
        durations, longest, total, per_turn = self._durations(self._active[actor])
        env, trace = self.env, self.trace
        start, turns = env.now, self._turn_totals[row]
        if trace.window_start is not None and start + longest[row] <= trace.horizon:
            trace.whole_episodes(self.actors.group_size, total[row])
        else:
            trace.episodes(start, durations[row].tolist())
        trace.inference_turns += turns
        trace.inference_s += turns * per_turn
        yield env.timeout(longest[row])
        self._active[actor] -= 1
        return version, start

    def finalize(self, horizon: float) -> None:
        """Nothing to do: episodes were recorded whole when their group started."""


class FineGeneration:
    """Every turn of every episode: a batched policy call on the actor's sampler, then an env step.

    The group's oldest version is the one its episodes' first policy calls sampled with.
    """

    def __init__(self, env: simpy.Environment, actors: ActorSpec, rng: np.random.Generator,
                 trace: Trace, weights: WeightTracker):
        self.env = env
        self.actors = actors
        self.trace = trace
        self.weights = weights
        self._samplers: dict[int, ActorSampler] = {}
        self._turns = Sampler(actors.turns, rng)
        self._steps = Sampler(actors.env_step_s, rng)
        self._open: dict[int, float] = {}  # running episodes: id -> start
        self._ids = itertools.count()

    def _sampler(self, actor: int) -> ActorSampler:
        if actor not in self._samplers:
            version = functools.partial(self.weights.version, actor)
            self._samplers[actor] = ActorSampler(self.env, self.actors.inference, version)
        return self._samplers[actor]

    def _episode(self, sampler: ActorSampler):
        env, trace = self.env, self.trace
        key, start, oldest = next(self._ids), env.now, None
        self._open[key] = start
        turns = max(1, round(self._turns()))
        for _ in range(turns):
            asked = env.now
            version = yield sampler.call()
            trace.inference_s += env.now - asked
            oldest = version if oldest is None else oldest
            step = self._steps()
            if step > 0:
                yield env.timeout(step)
        trace.inference_turns += turns
        del self._open[key]
        trace.episodes(start, [env.now - start])
        return oldest

    def generate(self, actor: int, version: int):
        """Runs one group; returns (oldest weights version used, start time)."""
        env, sampler = self.env, self._sampler(actor)
        start = env.now
        episodes = [env.process(self._episode(sampler)) for _ in range(self.actors.group_size)]
        yield simpy.AllOf(env, episodes)
        return min(p.value for p in episodes), start

    def finalize(self, horizon: float) -> None:
        for start in self._open.values():
            self.trace.episodes(start, [horizon - start], finished=False)


