"""The audit behind `headrace audit CONFIG | RUN_DIR`: every stage measured, the actor pool sized,
the bottleneck named (the command, which runs the measurement and the probe, is
`headrace.runtime.audit`).

1. Measure: with a CONFIG, a short run (`--duration`) of the user's own pipeline with every group
   traced (`run.trace_rate` 1); with a RUN_DIR, the traces and metrics it already holds.
2. Describe: per stage, the latency distribution (p50/p90/p99) and rate, from the traces
   (`headrace.metrics.traces`); the learner's consume capacity (groups per second of training); one
   actor's produce rate; the inference cost curve (`fixed_s + per_row_s x rows`, a least-squares
   fit over the traced policy calls).
3. Size: Little's law first — groups in flight = consume capacity x group latency (admission to
   put) x headroom — then a simulation (`headrace.sim.simulate`, driven by the measured
   distributions) of the candidate pools around it; the recommendation is the smallest pool whose
   predicted utilisation reaches the target with mean lag within `staleness.max_policy_lag`.
   An actor's core serves its policy calls (a fixed cost per call, a cost per row) and its
   turns' work outside them (event loop, environment steps, buffer puts: the measured CPU of
   those threads per turn); the simulation charges both to the actor's sampler, and
   environments per actor are capped where the rows alone would keep the core 90 % busy.
   `headrace.runtime.audit.with_probe` adds timed calls of up to `actor.max_batch` rows
   (`headrace.audit.probe`) to the traced ones, since a small pool's calls show nothing of a
   large pool's.
4. Report: the bottleneck by name, a plot (PNG) of predicted utilisation and lag against the pool,
   and `audit.json` in the run folder.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable

import numpy as np

from headrace import placement
from headrace.audit.hint import uniform_drop_factor
from headrace.config import Config, ConfigError, load
from headrace.metrics import traces as traces_lib
from headrace.metrics.records import read_records
from headrace.rundir import RunDir
from headrace.sim.simulate import plot_sweep, simulate
from headrace.sim.spec import (
    ActorSpec,
    BufferSpec,
    Dist,
    InferenceSpec,
    LearnerSpec,
    SimSpec,
    StalenessSpec,
    fixed,
)

ACTOR_BUSY_MAX = 0.9  # an actor's core this busy is the pool's limit (rows per actor capped)


def warmup_allowance_s(precompile: bool) -> float:
    """Seconds a measured run may take to start (spawning, compiling) before its window: more
    when actors compile every sampling program first (`sampling.precompile`)."""
    return 150.0 if precompile else 60.0


@dataclasses.dataclass
class Measured:
    """What one run showed, everything the sizing needs."""

    config: Config
    traces: list[dict]
    spans: dict[str, list[float]]
    step_s: list[float]  # learner train steps
    calls: np.ndarray  # [n, 2]: rows, seconds of each distinct traced policy call
    turns: list[int]
    utilization: float
    lag_mean: float
    window_s: float
    groups_put: float  # groups written over the window (all actors)
    put_s: float
    publish_s: float  # the learner's time off steps per publish (`read_run`)
    cpu_frac: float  # CPU an actor process used (cores), when actors are processes; 0: unknown
    turn_cpu_frac: float  # of it, the threads that run turns (event loop, its executor)
    turns_per_s: float  # turns one actor ran per second over the window
    episode_tokens: float  # tokens of an episode (mean)
    learner_cpu_s: float = 0.0  # the learner process's CPU per step (0: not measured)
    rows_per_call: float = 0.0  # rows (turns) a policy call served, mean (0: not measured)
    probed: int = 0  # of `calls`, those the sampler probe timed (`with_probe`)
    call_cpu_s: float = 0.0  # turn-side CPU per policy call (event loop), from the probe
    uniform_drop_factor: float = 1.0  # groups the learner took per group trained (`hint`)

    @property
    def group_size(self) -> int:
        return self.config.actor.group_size

    @property
    def busy_step_s(self) -> list[float]:
        """Learner steps as they run back to back. A learner on one core then also does the
        host work between steps (publishing, building batches, reading) while a step runs, work
        that a learner waiting for data did in its idle time: its steps stretch to the process's
        CPU per step, when that is more."""
        mean = float(np.mean(self.step_s))
        pinned = placement.learner_set(self.config.run, self.config.parallel.processes,
                                       placement.usable_cpus())
        if len(pinned) != 1 or self.learner_cpu_s <= mean:
            return self.step_s
        return [s * self.learner_cpu_s / mean for s in self.step_s]

    @property
    def groups_per_step(self) -> float:
        """Groups the learner takes from the buffer per step: a batch, and with
        `learner.drop_uniform_groups` the share it drops for equal rewards on top (the actors
        must make those too; drops for lag are the pool's excess, not its need)."""
        return self.config.learner.groups_per_batch * self.uniform_drop_factor

    @property
    def consume_capacity(self) -> float:
        """Groups per second the learner takes when never kept waiting."""
        return self.groups_per_step / float(np.mean(self.busy_step_s))

    @property
    def group_latency_s(self) -> float:
        """Admission to put: how long a group occupies its slot."""
        return float(np.mean(self.spans["generate"])) + self.put_s


def _without_outliers(calls: set[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """Drops calls slower than q75 + 3 IQR of all calls (a sampler compiling a new shape)."""
    if len(calls) < 8:
        return list(calls)
    seconds = np.array([end - start for start, end, _ in calls])
    q25, q75 = np.quantile(seconds, (0.25, 0.75))
    limit = q75 + 3 * (q75 - q25)
    return [c for c in calls if c[1] - c[0] <= limit]


def read_run(run_dir: str | pathlib.Path) -> Measured:
    """Loads a run folder's measurements (config.yaml, traces.jsonl, metrics.jsonl).

    Raises:
      ConfigError: the folder lacks a file the audit needs, or holds no complete trace.
    """
    run_dir = pathlib.Path(run_dir)
    for name in (RunDir.CONFIG, RunDir.TRACES, RunDir.METRICS):
        if not (run_dir / name).exists():
            raise ConfigError(f"{run_dir}: no {name}; audit a run folder written by headrace "
                              f"train with run.trace_rate > 0, or give a CONFIG to measure")
    config = load(run_dir / RunDir.CONFIG)
    traces = [t for t in traces_lib.read_traces(run_dir / RunDir.TRACES)
              if t["stages"].get("train_finished") is not None]
    if not traces:
        raise ConfigError(f"{run_dir}/{RunDir.TRACES}: no traced group was trained; "
                          "run longer or raise run.trace_rate")
    spans: dict[str, list[float]] = {}
    for trace in traces:
        for stage, values in traces_lib.durations(trace).items():
            spans.setdefault(stage, []).extend(values)
    # Steps that compiled and calls that look like compiles are start-up, not the steady state.
    steps = {(t["stages"]["train_started"], t["stages"]["train_finished"]) for t in traces
             if not t.get("compiled")}
    calls = _without_outliers(
        {(c[1], c[2], c[3]) for t in traces for e in t["episodes"] for c in e["inference"]})
    records = read_records(run_dir)
    trained = [r for r in records if r.get("learner/step", 0) >= 1]
    last = records[-1]
    window = trained[-1]["time"] - trained[0]["time"] if len(trained) > 1 else 0.0
    put = (last.get("actor/episodes", 0) - (trained[0].get("actor/episodes", 0) if trained else 0))
    lags = [r["staleness/lag_mean"] for r in trained if "staleness/lag_mean" in r]
    turns = [len(e["env"]) or 1 for t in traces for e in t["episodes"]]
    rows = [r["actor/batch_rows_mean"] for r in trained if "actor/batch_rows_mean" in r]

    def actor_cpu(key: str) -> float:  # an actor process's median, when actors are processes
        values = [r[key] for r in trained if key in r]
        return float(np.median(values)) if values and config.run.launcher == "processes" else 0.0

    return Measured(
        config=config, traces=traces, spans=spans,
        step_s=[end - start for start, end in steps] or [last.get("learner/step_s_mean", 1.0)],
        calls=np.array([(rows, end - start) for start, end, rows in calls], dtype=np.float64
                       ).reshape(-1, 2),
        turns=turns,
        utilization=float(last.get("learner/utilization", 0.0)),
        lag_mean=float(np.mean(lags)) if lags else 0.0,
        window_s=window, groups_put=put / config.actor.group_size,
        put_s=float(last.get("actor/put_s_p50", 0.0)),
        # The learner's host time between steps (publishing's copy to the host, bookkeeping;
        # the store write runs on its own thread), charged at each publish for the steps since
        # the last; runs from before it was measured: the store write, as before.
        publish_s=(last["learner/between_steps_s_p50"] * config.learner.publish_every
                   if "learner/between_steps_s_p50" in last
                   else float(last.get("weights/publish_s_p50", 0.0))),
        cpu_frac=actor_cpu("actor/cpu_frac"), turn_cpu_frac=actor_cpu("actor/turn_cpu_frac"),
        turns_per_s=(put * float(np.mean(turns)) / window / config.actor.num_actors
                     if window > 0 else 0.0),
        episode_tokens=float(last.get("episode/length_mean", 0.0)),
        rows_per_call=float(np.median(rows)) if rows else 0.0,
        uniform_drop_factor=uniform_drop_factor(last),
        learner_cpu_s=(last["learner/cpu_frac"] / last["learner/steps_per_s"]  # its own process
                       if config.run.launcher == "processes" and last.get("learner/cpu_frac")
                       and last.get("learner/steps_per_s") else 0.0))


def fit_inference(calls: np.ndarray) -> tuple[float, float]:
    """(fixed_s, per_row_s) of `seconds = fixed + per_row x rows`, least squares, both >= 0."""
    if len(calls) == 0:
        return 0.0, 0.0
    rows, seconds = calls[:, 0], calls[:, 1]
    if np.ptp(rows) == 0:  # one batch size seen: the call is all fixed cost as far as we know
        return float(np.mean(seconds)), 0.0
    slope, intercept = np.polyfit(rows, seconds, 1)
    if intercept < 0:
        return 0.0, float(np.sum(seconds * rows) / np.sum(rows * rows))
    if slope < 0:
        return float(np.mean(seconds)), 0.0
    return float(intercept), float(slope)


def admitting_limits(envs: int, group_size: int, groups_per_batch: int, given: int = 0,
                     floor: int = 4) -> tuple[int, int]:
    """(max_policy_lag, buffer capacity) that admit a pool of `envs` environments (`given`: a
    limit chosen already, with the buffer that holds all it admits).

    Admission lets about (limit + 1) batches be in flight or queued (a group must be trained
    within the limit of the weights it started with), so a limit that admits only the pool's
    groups already binds: a group's lag also counts its slowest episode and its wait in the
    buffer, and a binding limit drops groups the pool has paid for. The limit admits twice the
    pool, which then bounds what is in flight; the buffer holds all that admission lets in (a
    smaller one blocks finished groups' puts, and their slots idle, when episodes finish
    together).
    """
    lag = given or max(floor, math.ceil(2 * envs / group_size / groups_per_batch) - 1)
    return lag, (lag + 1) * groups_per_batch


def sim_spec(m: Measured, actors: int, envs_per_actor: int, duration_s: float,
             limits: tuple[int, int] | None = None) -> SimSpec:
    """The pipeline of `m` with a given pool, every timing from the measurements; `limits`
    (max_policy_lag, buffer capacity) replace the measured run's."""
    c = m.config
    lag, capacity = limits or (c.staleness.max_policy_lag, c.buffer.capacity)
    fixed_s, per_row_s = actor_costs(m, actors)
    model = "fine" if actors * envs_per_actor <= 20_000 else "aggregated"
    return SimSpec(
        duration_s=duration_s, model=model,
        actors=ActorSpec(
            count=actors, envs_per_actor=envs_per_actor, group_size=m.group_size,
            turns=Dist(kind="empirical", samples=tuple(float(t) for t in m.turns)),
            env_step_s=Dist(kind="empirical", samples=tuple(m.spans.get("env_step", [0.0]))),
            inference=InferenceSpec(fixed_s=fixed_s, per_row_s=per_row_s,
                                    max_batch=c.actor.max_batch,
                                    wait_s=c.actor.batch_wait_ms / 1e3),
            pickup_s=Dist(kind="empirical", samples=tuple(m.spans.get("pickup", [0.0])))),
        buffer=BufferSpec(capacity=capacity, put_s=fixed(m.put_s)),
        learner=LearnerSpec(step_s=Dist(kind="empirical", samples=tuple(m.busy_step_s)),
                            groups_per_batch=max(1, round(m.groups_per_step)),
                            publish_every=c.learner.publish_every, publish_s=fixed(m.publish_s),
                            prefetch=2),  # the reader queues 2 batches of groups ahead
        staleness=StalenessSpec(
            max_policy_lag=lag, admission=c.run.mode == "async",
            max_ready_batches=c.staleness.max_ready_batches if c.run.mode == "async" else 0))


def turn_cost_s(m: Measured) -> float:
    """CPU seconds a turn costs its actor outside the policy call (event loop, environment step,
    buffer put): the turn threads' measured CPU less the part the probe puts on policy calls
    (`call_cpu_s` per call, at the measured rows per call), per turn; 0 when not measured."""
    if m.turn_cpu_frac <= 0 or m.turns_per_s <= 0:
        return 0.0
    calls_per_s = m.turns_per_s / m.rows_per_call if m.rows_per_call > 0 else 0.0
    return max(0.0, m.turn_cpu_frac - m.call_cpu_s * calls_per_s) / m.turns_per_s


def actor_costs(m: Measured, actors: int) -> tuple[float, float]:
    """(fixed_s, per_row_s) of a policy call as the actor's core sees it: the fitted call cost,
    plus the event loop's part per call (`call_cpu_s`) and each row's turn outside the call
    (`turn_cost_s`), as one core serves all of it; all stretched when more actor processes than
    actor cores share them."""
    fixed_s, per_row_s = fit_inference(m.calls)
    share = max(1.0, actors / actor_cores(m.config)) if m.cpu_frac > 0 else 1.0
    call_s = m.call_cpu_s if m.rows_per_call > 0 and m.turn_cpu_frac > 0 else 0.0
    return (fixed_s + call_s) * share, (per_row_s + turn_cost_s(m)) * share


def envs_cap(m: Measured) -> int:
    """Most environments one actor serves before its rows keep its core ACTOR_BUSY_MAX busy:
    each turn costs `per_row_s` (`actor_costs`) and an environment runs one every `turn_s`, as
    measured (environments per actor / turns per second: an episode also waits for its group's
    slowest and for admission), else an env step + a policy call. Calls' fixed costs take the
    rest of the core, a share that shrinks as calls grow (they batch what queued). Without a
    per-row cost (none measured), `actor.max_batch`."""
    _, per_row_s = actor_costs(m, 1)
    turn_s = (m.config.actor.envs_per_actor / m.turns_per_s if m.turns_per_s > 0 else
              float(np.mean(m.spans.get("env_step", [0.0])))
              + float(np.mean(m.spans.get("inference", [0.0]))))
    g = m.group_size
    cap = ACTOR_BUSY_MAX * turn_s / per_row_s if per_row_s > 0 else m.config.actor.max_batch
    return max(g, int(cap) // g * g)


def actor_cores(config: Config) -> int:
    """Cores the actor processes can use on this machine (`run.actor_cpus`, else those the
    learner's pinning leaves: `placement.actor_cpus`; all of them when neither is pinned)."""
    usable, processes = placement.usable_cpus(), config.parallel.processes
    return len(placement.actor_cpus(config.run, usable, processes)) or max(
        1, len(usable) - len(placement.learner_set(config.run, processes, usable)))


def split_pool(total_envs: int, cap: int, group_size: int) -> tuple[int, int]:
    """(actors, envs per actor) for at least `total_envs` environments, at most `cap` per actor."""
    total = max(group_size, math.ceil(total_envs / group_size) * group_size)
    actors = math.ceil(total / cap)
    per = math.ceil(total / actors / group_size) * group_size
    return actors, per


def little(m: Measured, headroom: float) -> dict:
    """Little's law: the environments in flight that keep the learner fed."""
    groups = m.consume_capacity * m.group_latency_s
    return {"consume_groups_per_s": m.consume_capacity, "group_latency_s": m.group_latency_s,
            "groups_in_flight": groups, "headroom": headroom,
            "envs_needed": math.ceil(groups * headroom * m.group_size)}


def predict(m: Measured, actors: int, envs_per_actor: int, duration_s: float,
            seed: int = 0, limits: tuple[int, int] | None = None) -> dict:
    """The simulation's report for a pool (measured distributions, nothing of the run it predicts)."""
    return simulate(sim_spec(m, actors, envs_per_actor, duration_s, limits), seed)


def recommend(m: Measured, *, target: float, headroom: float, duration_s: float,
              admit_pool: bool = False, max_envs: int | None = None,
              progress: Callable[[str], None] | None = None) -> dict:
    """The smallest simulated pool reaching `target` with mean lag within the limit.

    `admit_pool`: each pool is simulated with the staleness limit and buffer that admit it
    (`admitting_limits`) instead of the measured run's, and the recommendation says which.
    `max_envs`: no candidate pool is larger. `progress` is told of each pool as its simulation
    starts (a fast pipeline's takes tens of seconds: events per episode turn)."""
    law = little(m, headroom)
    cap = envs_cap(m)
    g = m.group_size
    cores = actor_cores(m.config) if m.cpu_frac > 0 else None
    largest = max_envs or math.inf
    sizes = [law["envs_needed"] * f for f in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)]
    if cores is not None:  # the largest pool the actor cores can run is always a candidate
        sizes.append(min(cores * cap, law["envs_needed"]))
    pools = {split_pool(int(min(size, largest)), cap, g) for size in sizes}
    candidates = sorted(pools, key=lambda p: p[0] * p[1])
    points = []
    for index, (actors, per) in enumerate(candidates):
        if progress is not None:
            progress(f"simulating pool {index + 1}/{len(candidates)}: {actors} actor(s) x {per} "
                     f"envs, {duration_s:g} simulated s")
        limits = (admitting_limits(actors * per, g, m.config.learner.groups_per_batch)
                  if admit_pool else None)
        lag = limits[0] if limits else m.config.staleness.max_policy_lag
        report = predict(m, actors, per, duration_s, limits=limits)
        points.append({"actors": actors, "envs_per_actor": per, "envs": actors * per,
                       "max_policy_lag": lag,
                       "learner_utilization": report["learner_utilization"],
                       "staleness_lag_mean": report["staleness_lag_mean"],
                       "staleness_lag_max": report["staleness_lag_max"],
                       "drop_rate": report["drop_rate"]})
    for p in points:  # actor processes beyond the cores only share them: no more throughput
        p["fits_cores"] = cores is None or p["actors"] <= cores
    good = [p for p in points if p["learner_utilization"] >= target and p["fits_cores"]
            and (p["staleness_lag_mean"] or 0) <= p["max_policy_lag"]]
    fitting = [p for p in points if p["fits_cores"]] or points[:1]
    choice = good[0] if good else max(fitting, key=lambda p: p["learner_utilization"])
    return {"little": law, "envs_per_actor_cap": cap, "actor_cores": cores, "sweep": points,
            "actors": choice["actors"], "envs_per_actor": choice["envs_per_actor"],
            "max_policy_lag": choice["max_policy_lag"],
            "predicted_utilization": choice["learner_utilization"],
            "predicted_lag_mean": choice["staleness_lag_mean"], "reached": bool(good)}


def bottleneck(m: Measured, target: float) -> tuple[str, str]:
    """(name, why): what limits learner utilisation in the measured run."""
    mean = {k: float(np.mean(v)) for k, v in m.spans.items()}
    if m.utilization >= target:
        return "learner", (f"utilisation {m.utilization:.2f} >= {target}: actors keep up; only a "
                           "faster learner step raises throughput")
    turns = float(np.mean(m.turns))
    env_s, infer_s = mean.get("env_step", 0.0) * turns, mean.get("inference", 0.0) * turns
    buffer_s = m.put_s  # a put's own latency (time queued in the buffer is the learner's)
    sync_s = mean.get("pickup", 0.0) + m.publish_s
    episode_s = max(mean.get("episode", 0.0), 1e-9)
    shares = {"environment": env_s / episode_s, "inference": infer_s / episode_s}
    if buffer_s > 0.1 * mean.get("generate", episode_s):
        return "buffer", (f"a put takes {buffer_s:.3f} s, over 10 % of the group latency "
                          f"{mean.get('generate', episode_s):.3f} s")
    if m.cpu_frac >= ACTOR_BUSY_MAX:
        return "actor CPU", (f"an actor process used {m.cpu_frac:.2f} cores; more environments "
                             "per actor would only queue: add actor cores")
    if sync_s > float(np.mean(m.step_s)):
        return "weight sync", (f"publish + pickup {sync_s:.3f} s exceed a learner step "
                               f"{np.mean(m.step_s):.3f} s")
    name = max(shares, key=shares.get)
    return name, (f"too few environments in flight; an episode spends {shares['environment']:.0%}"
                  f" in environment steps and {shares['inference']:.0%} in policy calls")


def analyze(run_dir: str | pathlib.Path, *, target: float = 0.95, headroom: float = 1.2,
            duration_s: float = 300.0, plot: bool = True, admit_pool: bool = False,
            measured: Measured | None = None, max_envs: int | None = None,
            progress: Callable[[str], None] | None = None) -> dict:
    """The audit report of a run folder; also written to RUN_DIR/audit.json (and audit.png).
    `admit_pool`: size the staleness limit and buffer to each pool (`recommend`); `measured`:
    the folder's measurements as `read_run` (and `with_probe`) gave them; `max_envs`: the
    largest pool to simulate; `progress`: as `recommend`'s."""
    run_dir = pathlib.Path(run_dir)
    m = measured or read_run(run_dir)
    c = m.config
    name, why = bottleneck(m, target)
    rec = recommend(m, target=target, headroom=headroom, duration_s=duration_s,
                    admit_pool=admit_pool, max_envs=max_envs, progress=progress)
    fixed_s, per_row_s = fit_inference(m.calls)
    report = {
        "run_dir": str(run_dir),
        "stages": traces_lib.summarize(m.spans),
        "traced_groups": len(m.traces),
        "measured": {"actors": c.actor.num_actors, "envs_per_actor": c.actor.envs_per_actor,
                     "learner_utilization": m.utilization, "lag_mean": m.lag_mean,
                     "window_s": m.window_s},
        "rates": {"learner_consume_groups_per_s": m.consume_capacity,
                  "learner_step_s_mean": float(np.mean(m.step_s)),
                  "learner_cpu_s_per_step": m.learner_cpu_s,
                  "actor_produce_groups_per_s": (m.groups_put / m.window_s / c.actor.num_actors
                                                 if m.window_s > 0 else None),
                  "inference_fixed_s": fixed_s, "inference_per_row_s": per_row_s,
                  "inference_calls_probed": m.probed,
                  "actor_cpu_frac": m.cpu_frac, "actor_turn_cpu_frac": m.turn_cpu_frac,
                  "actor_turns_per_s": m.turns_per_s, "actor_rows_per_call": m.rows_per_call,
                  "turn_cost_s": turn_cost_s(m), "call_cpu_s": m.call_cpu_s},
        "bottleneck": name, "why": why,
        "recommendation": rec, "target_utilization": target,
    }
    if plot:
        points = [{"actors": p["envs"], "learner_utilization": p["learner_utilization"],
                   "staleness_lag_mean": p["staleness_lag_mean"],
                   "staleness_lag_max": p["staleness_lag_max"], "drop_rate": p["drop_rate"]}
                  for p in rec["sweep"]]
        plot_sweep(points, str(run_dir / RunDir.AUDIT_PLOT), xlabel="environments in flight")
        report["plot"] = str(run_dir / RunDir.AUDIT_PLOT)
    (run_dir / RunDir.AUDIT).write_text(json.dumps(report, indent=1, default=float))
    return report


def format_report(report: dict) -> str:
    lines = ["stage           count      p50       p90       p99   (seconds)"]
    for stage, s in report["stages"].items():
        lines.append(f"{stage:<14} {s['count']:>6} {s['p50']:>9.4f} {s['p90']:>9.4f} "
                     f"{s['p99']:>9.4f}")
    r, rec, law = report["rates"], report["recommendation"], report["recommendation"]["little"]
    meas = report["measured"]
    lines += [
        "",
        f"measured: {meas['actors']} actor(s) x {meas['envs_per_actor']} envs: utilisation "
        f"{meas['learner_utilization']:.3f}, lag mean {meas['lag_mean']:.2f}",
        f"learner consumes {r['learner_consume_groups_per_s']:.2f} groups/s "
        f"(step {r['learner_step_s_mean']:.3f} s); one actor produced "
        f"{r['actor_produce_groups_per_s'] or 0:.2f} groups/s",
        f"actor core: a policy call {r['inference_fixed_s'] * 1e3:.2f} ms + "
        f"{r['inference_per_row_s'] * 1e3:.3f} ms per row; outside calls "
        f"{r['turn_cost_s'] * 1e3:.3f} ms per turn + {r['call_cpu_s'] * 1e3:.3f} ms per call",
        f"Little's law: {law['consume_groups_per_s']:.2f} groups/s x {law['group_latency_s']:.2f} s"
        f" = {law['groups_in_flight']:.1f} groups in flight; x{law['headroom']} headroom = "
        f"{law['envs_needed']} environments",
        f"recommended: {rec['actors']} actor(s) x {rec['envs_per_actor']} envs, "
        f"max_policy_lag {rec['max_policy_lag']} -> predicted utilisation "
        f"{rec['predicted_utilization']:.3f}, lag {rec['predicted_lag_mean'] or 0:.2f}"
        + ("" if rec["reached"] else f"  (target {report['target_utilization']} not reached)"),
        f"bottleneck: {report['bottleneck']} ({report['why']})",
    ]
    if "plot" in report:
        lines.append(f"plot: {report['plot']}")
    return "\n".join(lines)
