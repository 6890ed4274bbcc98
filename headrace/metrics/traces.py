"""End-to-end traces: every stage of a sample of groups, from admission to the weight pickup.

Actors stamp every group (`requested`, `admitted`, `started`, `finished`, `put` in each
trajectory's `timings`) and, for a traced group (`run.trace_rate`, chosen by a stable hash of the
group id), every turn's policy call and environment step (`actor.episode.trace_timings`). The
learner's `Tracer` adds `got` (read from the buffer), `gated` (passed the staleness gate),
`train_started`/`train_finished` (the step that trained it), `published` (the start of the publish
that carried its update) and `picked_up` (the first actor sampling with that version or a newer one:
the loop is closed), then writes one JSON object per traced group to `traces.jsonl`:

    {"group_id", "task_id", "actor_id", "env", "step", "compiled", "trained_version",
     "oldest_version", "lag",
     "stages": {stage: unix time}, "durations": {stage: [seconds, ...]},
     "episodes": [{"started", "finished", "inference": [[requested, started, finished, rows]],
                   "env": [[started, finished]]}]}

A trace waits at most `pickup_timeout_s` for its pickup (forced lag or a stopped fleet may never
pick a version up); it is then written with `picked_up: null`. Stage durations of every traced
group go to the metrics as `trace/<stage>_s` (p50/p90/p99 in metrics.jsonl), and `close` writes
their distributions to `stages.json` beside the traces. Two stages are measured for every group,
traced or not: `buffer/wait_s` (put to read) and `learner/queue_s` (read to train step).

Thread safety: `read` runs on the learner's reader thread, everything else on its training thread;
the per-group stamps they write are disjoint keys of one dict.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from headrace.metrics.core import Metrics
from headrace.rundir import RunDir
from headrace.types import Entry, Group

POLL_S = 0.2  # how often the weight store is asked about pickups

# Group-level stages: (name, from stamp, to stamp). Per-episode stages are added by `durations`.
GROUP_STAGES = (
    ("admission", "requested", "admitted"),
    ("generate", "admitted", "finished"),  # the group's last episode
    ("buffer", "put", "got"),
    ("gate", "got", "gated"),
    ("batch", "gated", "train_started"),
    ("train", "train_started", "train_finished"),
    ("publish", "train_finished", "published"),
    ("pickup", "published", "picked_up"),
    ("end_to_end", "requested", "picked_up"),
)


def durations(trace: dict) -> dict[str, list[float]]:
    """Seconds spent in each stage of one trace (the single definition of every stage)."""
    stages = trace["stages"]
    out: dict[str, list[float]] = {}
    for name, start, end in GROUP_STAGES:
        if stages.get(start) is not None and stages.get(end) is not None:
            out[name] = [stages[end] - stages[start]]
    episodes = trace["episodes"]
    out["episode"] = [e["finished"] - e["started"] for e in episodes]
    out["env_step"] = [f - s for e in episodes for s, f in e["env"]]
    out["inference"] = [f - r for e in episodes for r, _, f, _ in e["inference"]]
    out["inference_call"] = [f - s for e in episodes for _, s, f, _ in e["inference"]]
    return {k: v for k, v in out.items() if v}


def _episode(timings: dict[str, float]) -> dict:
    calls, steps = [], []
    i = 0
    while f"infer.{i}.requested" in timings:
        calls.append([timings[f"infer.{i}.{k}"] for k in ("requested", "started", "finished")]
                     + [int(timings[f"infer.{i}.rows"])])
        i += 1
    i = 0
    while f"env.{i}.started" in timings:
        steps.append([timings[f"env.{i}.started"], timings[f"env.{i}.finished"]])
        i += 1
    return {"started": timings["started"], "finished": timings["finished"], "inference": calls,
            "env": steps}


class Pickups(Protocol):
    """What the tracer asks of the weight store (`headrace.weights.base.WeightStore` has it)."""

    def pickup_time(self, version: int) -> float | None:
        """Unix time `version` was first picked up by any actor, or None if not (yet)."""


class Tracer:
    def __init__(self, path: pathlib.Path | None, weights: Pickups, metrics: Metrics,
                 pickup_timeout_s: float = 60.0):
        """`path`: where traces.jsonl goes (its folder gets stages.json); None: metrics only."""
        self.path = path
        self.weights = weights
        self.metrics = metrics
        self.pickup_timeout_s = pickup_timeout_s
        self._file = open(path, "a") if path is not None else None  # noqa: SIM115 (closed in close)
        self._waiting: list[dict] = []  # trained, not yet published
        self._published: list[tuple[dict, float]] = []  # (trace, give-up time), waiting for pickup
        self._all: dict[str, list[float]] = {}
        self._pickups: dict[int, float] = {}  # version -> first pickup (known ones)
        self._latest = -1
        self._next_poll = 0.0
        self.written = 0

    @staticmethod
    def _stamps(group: Group) -> dict[str, float]:
        return group.trajectories[0].timings

    def read(self, entries: Iterable[Entry]) -> None:
        """Reader thread: entries just read from the buffer."""
        now = time.time()
        waits = []
        for entry in entries:
            stamps = self._stamps(entry.group)
            stamps["got"] = now
            if "put" in stamps:
                waits.append(now - stamps["put"])
        self.metrics.observe_many("buffer/wait_s", waits)

    def gated(self, entry: Entry) -> None:
        self._stamps(entry.group)["gated"] = time.time()

    def trained(self, entries: list[Entry], started: float, finished: float, version: int,
                step: int, compiled: bool = False) -> None:
        """Training thread: `entries` were trained at `version` by learner step `step` (1-based),
        which ran over [started, finished] (`compiled`: it included an XLA compile)."""
        self.metrics.observe_many("learner/queue_s", [
            started - self._stamps(e.group)["got"] for e in entries
            if "got" in self._stamps(e.group)])
        for entry in entries:
            group = entry.group
            stamps = self._stamps(group)
            if "traced" not in stamps:
                continue
            first = group.trajectories
            self._waiting.append({
                "group_id": group.group_id, "task_id": group.task_id,
                "actor_id": first[0].actor_id, "env": first[0].env,
                "step": step, "compiled": compiled, "trained_version": version,
                "oldest_version": int(group.oldest_version),
                "lag": version - int(group.oldest_version),
                "stages": {
                    **{k: stamps.get(k) for k in ("requested", "admitted", "put", "got", "gated")},
                    "started": min(t.timings["started"] for t in first),
                    "finished": max(t.timings["finished"] for t in first),
                    "train_started": started, "train_finished": finished,
                    "published": None, "picked_up": None},
                "episodes": [_episode(t.timings) for t in first]})

    def published(self, version: int, at: float) -> None:
        """The learner published `version` at `at`: it carries every update trained so far."""
        self._latest = max(self._latest, version)
        for trace in self._waiting:
            trace["stages"]["published"] = at
            trace["published_version"] = version
            self._published.append((trace, at + self.pickup_timeout_s))
        self._waiting = []
        self.poll()

    def poll(self, flush: bool = False) -> None:
        """Writes the traces whose update has reached an actor (or that waited too long).

        The loop of a group trained into version v closes when an actor first samples with any
        version >= v (an actor that was busy may skip v). The store is asked at most every
        `POLL_S`; a version's pickup time, once known, is kept.
        """
        now = time.time()
        if not self._published or (not flush and now < self._next_poll):
            return
        self._next_poll = now + POLL_S
        oldest = min(trace["published_version"] for trace, _ in self._published)
        first: dict[int, float | None] = {}
        best = None
        for version in range(self._latest, oldest - 1, -1):  # suffix minimum, newest first
            if version not in self._pickups:
                found = self.weights.pickup_time(version)
                if found is not None:
                    self._pickups[version] = found
            found = self._pickups.get(version)
            if found is not None:
                best = found if best is None else min(best, found)
            first[version] = best
        keep = []
        for trace, give_up in self._published:
            picked = first.get(trace["published_version"])
            if picked is not None or flush or now >= give_up:
                trace["stages"]["picked_up"] = picked
                self._write(trace)
            else:
                keep.append((trace, give_up))
        self._published = keep
        for version in [v for v in self._pickups if v < oldest]:
            del self._pickups[version]

    def _write(self, trace: dict) -> None:
        trace.pop("published_version", None)
        trace["durations"] = spans = durations(trace)
        for stage, values in spans.items():
            self.metrics.observe_many(f"trace/{stage}_s", values)
            self._all.setdefault(stage, []).extend(values)
        self.written += 1
        if self._file is not None:
            self._file.write(json.dumps(trace) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Writes what is still waiting (unpublished traces are dropped: no update carries them)
        and the stage distributions to stages.json."""
        self.poll(flush=True)
        if self._file is None:
            return
        self._file.close()
        self._file = None
        (self.path.parent / RunDir.STAGES).write_text(json.dumps(summarize(self._all), indent=1))


def summarize(spans: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per stage: count, mean, p50, p90, p99 and max of its durations in seconds."""
    out = {}
    for stage, values in spans.items():
        a = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = np.quantile(a, (0.5, 0.9, 0.99))
        out[stage] = {"count": int(a.size), "mean": float(a.mean()), "p50": float(p50),
                      "p90": float(p90), "p99": float(p99), "max": float(a.max())}
    return out


def read_traces(path: pathlib.Path) -> list[dict]:
    """The traces of a run folder's traces.jsonl (a torn last line, from a crash, is skipped)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
