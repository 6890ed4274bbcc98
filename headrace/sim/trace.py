"""What one simulated run observes (`Trace`, `GroupRecord`) and the weight versions each actor
holds (`WeightTracker`): shared by the actor side (`headrace.sim.actors`) and the pipeline
(`headrace.sim.pipeline`)."""

from __future__ import annotations

import math
from array import array

import numpy as np

from headrace.sim.spec import Dist


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
    small however many groups a run produces. `headrace.sim.simulate.summarize` makes the report.
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
