"""`headrace simulate SPEC`: predict learner utilisation, buffer depth, lag and drops for a fleet.

A discrete-event simulation (SimPy) of the whole pipeline of docs/design.md, driven by measured or given
distributions (see `headrace.sim.spec` for the spec and docs/simulation.md for the model):

    report = simulate(load_spec("examples/simulate_large.yaml"))
    points = sweep(spec, actors=[500, 1000, 2000]); plot_sweep(points, "sweep.png")

Every prediction is measured over the steady-state window, from the start of the first train step
to the end of the run (`learner/utilization`, docs/metrics.md); a run in which the learner never trains
reports over the whole run. Report keys that predict a metric of docs/metrics.md use its name with `/`
written as `_`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence

import numpy as np

from headrace.config import ConfigError
from headrace.sim.pipeline import Pipeline, Trace
from headrace.sim.spec import SimSpec, load_spec, with_actors

SWEEP_COLUMNS = ("actors", "learner_utilization", "buffer_depth_mean", "staleness_lag_mean",
                 "staleness_lag_max", "drop_rate", "groups_produced_per_s", "actor_idle_frac",
                 "wall_s")


def _overlap(starts: np.ndarray, ends: np.ndarray, lo: float, hi: float) -> float:
    """Total length of the intervals [starts, ends) inside [lo, hi)."""
    if len(starts) == 0:
        return 0.0
    return float(np.clip(np.minimum(ends, hi) - np.maximum(starts, lo), 0, None).sum())


def _time_weighted(times, values, lo: float, hi: float) -> tuple[float, float]:
    """Mean and p99 of a piecewise-constant series (value[i] from times[i]) over [lo, hi)."""
    t, v = np.asarray(times), np.asarray(values, dtype=np.float64)
    weight = np.clip(np.minimum(np.append(t[1:], hi), hi) - np.maximum(t, lo), 0, None)
    if weight.sum() <= 0:
        return float(v[-1]), float(v[-1])
    order = np.argsort(v, kind="stable")
    cumulative = np.cumsum(weight[order])
    p99 = v[order][np.searchsorted(cumulative, 0.99 * cumulative[-1])]
    return float((v * weight).sum() / weight.sum()), float(p99)


def _mean(values) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def summarize(trace: Trace, spec: SimSpec) -> dict:
    """The report of one closed Trace: predictions over its steady-state window (module doc)."""
    horizon, actors, learner = spec.duration_s, spec.actors, spec.learner
    lo = trace.window_start if trace.window_start is not None else 0.0
    span = horizon - lo
    trained = bool(trace.train_start) and span > 0
    if span <= 0:  # the first step started exactly at the horizon: report the whole run
        lo, span = 0.0, horizon
    train_s = _overlap(np.asarray(trace.train_start), np.asarray(trace.train_end), lo, horizon)
    depth_mean, depth_p99 = _time_weighted(trace.depth_t, trace.depth_v, lo, horizon)
    lag, lag_gen = np.asarray(trace.trained_lag), np.asarray(trace.trained_lag_gen)
    kept, dropped = len(lag), trace.dropped
    steps_done = int(np.sum(np.asarray(trace.train_end) <= horizon))
    group_s = _mean(trace.group_s)
    consume_capacity = learner.groups_per_batch / (
        learner.step_s.expected + learner.publish_s.expected / learner.publish_every)
    group_slot_s = actors.count * actors.slots * span
    return {
        "model": spec.model,
        "actors": actors.count,
        "duration_s": horizon,
        "window_s": span,
        "learner_utilization": train_s / span if trained else 0.0,
        "learner_steps": steps_done,
        "learner_steps_per_s": steps_done / span if trained else 0.0,
        "buffer_depth_mean": depth_mean,
        "buffer_depth_p99": depth_p99,
        "groups_produced_per_s": (trace.landed - trace.landed_before) / span,
        "groups_consumed_per_s": kept / span if trained else 0.0,
        "groups_dropped_per_s": (dropped - trace.dropped_before) / span,
        "staleness_lag_mean": _mean(lag),
        "staleness_lag_max": int(lag.max()) if kept else None,
        "staleness_lag_gen_mean": _mean(lag_gen),
        "staleness_lag_queue_mean": _mean(lag - lag_gen),
        "staleness_age_s_p99": float(np.quantile(trace.trained_age, 0.99)) if kept else None,
        "staleness_dropped_lag": dropped,
        "drop_rate": dropped / (dropped + kept) if dropped + kept else 0.0,
        "actor_idle_frac": 1.0 - trace.busy_env_s / (actors.count * actors.envs_per_actor * span),
        "actor_admission_wait_frac": trace.wait_s["admission"] / group_slot_s,
        "actor_put_blocked_frac": trace.wait_s["put"] / group_slot_s,
        "actor_inference_s": (trace.inference_s / trace.inference_turns
                              if trace.inference_turns else 0.0),
        "episode_s_mean": trace.episode_s / trace.episodes_done if trace.episodes_done else None,
        "group_s_mean": group_s,
        "group_s_p90": float(np.quantile(trace.group_s, 0.9)) if len(trace.group_s) else None,
        "little_actors_needed": (math.ceil(consume_capacity * group_s / actors.slots)
                                 if len(trace.group_s) else None),
        "weights_publishes": trace.publishes,
    }


def simulate(spec: SimSpec, seed: int = 0) -> dict:
    """Runs the simulation of `spec` and returns its report (see `summarize`) plus `wall_s` (the
    run time in seconds) and `sim_speed` (simulated seconds per second of run time)."""
    started = time.perf_counter()
    trace = Pipeline(spec, seed).run()
    report = summarize(trace, spec)
    wall = time.perf_counter() - started
    report.update(seed=seed, wall_s=wall, sim_speed=spec.duration_s / max(wall, 1e-9))
    return report


def sweep(spec: SimSpec, actors: Sequence[int], seed: int = 0) -> list[dict]:
    """One report per fleet size in `actors` (all else as in `spec`), in the given order.

    Raises:
      ConfigError: an actor count is below 1.
    """
    for count in actors:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"sweep actors={count!r}: each must be an integer >= 1")
    return [simulate(with_actors(spec, count), seed) for count in actors]


def plot_sweep(points: Sequence[dict], path: str, xlabel: str = "actors") -> None:
    """Writes a PNG of predicted learner utilisation (and drop rate) and policy lag against the
    number of actors (the points' `actors`, named `xlabel`), from `sweep`'s reports."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    actors = [p["actors"] for p in points]
    nan = float("nan")
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(actors, [p["learner_utilization"] for p in points], "o-", color="tab:blue",
            label="learner utilisation")
    ax.plot(actors, [p["drop_rate"] for p in points], "s:", color="tab:red", label="drop rate")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    lag_ax = ax.twinx()
    lag_ax.plot(actors, [nan if p["staleness_lag_mean"] is None else p["staleness_lag_mean"]
                         for p in points], "^--", color="tab:green", label="lag mean")
    lag_ax.plot(actors, [nan if p["staleness_lag_max"] is None else p["staleness_lag_max"]
                         for p in points], "v--", color="tab:olive", label="lag max")
    lag_ax.set_ylabel("policy lag (versions)")
    top = max([p["staleness_lag_max"] or 0 for p in points] + [1])
    lag_ax.set_ylim(0, top * 1.15 + 0.5)
    handles = ax.get_legend_handles_labels()[0] + lag_ax.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="lower right", fontsize=8)
    ax.set_title(f"predicted utilisation and lag against {xlabel}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --- command line --------------------------------------------------------------------------------


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_report(report: dict) -> str:
    width = max(len(k) for k in report)
    return "\n".join(f"{k:<{width}}  {_fmt(v)}" for k, v in report.items())


def format_sweep(points: Sequence[dict]) -> str:
    rows = [SWEEP_COLUMNS] + [tuple(_fmt(p[c]) for c in SWEEP_COLUMNS) for p in points]
    widths = [max(len(r[i]) for r in rows) for i in range(len(SWEEP_COLUMNS))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
                     for row in rows)


def _parse_actors(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--sweep {text!r}: expected actor counts like 100,200,400") from None
    if not counts or min(counts) < 1:
        raise ConfigError(f"--sweep {text!r}: expected actor counts >= 1 like 100,200,400")
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    """`headrace simulate SPEC [--duration S] [--json] [--sweep 100,200,...] [--plot out.png]`.

    Returns 0 on success and 2 on a bad spec or argument (one line on stderr says what and where).
    With --json, stdout carries exactly one JSON object (the report, or {"sweep": [...]}) and the
    table goes to stderr.
    """
    parser = argparse.ArgumentParser(
        prog="headrace simulate",
        description="Predict learner utilisation, buffer depth, policy lag and drops for a planned "
                    "actor fleet (discrete-event simulation; see docs/simulation.md).")
    parser.add_argument("spec", help="YAML spec of the planned pipeline")
    parser.add_argument("--duration", type=float, help="simulated seconds (spec: duration_s)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--sweep", help="comma-separated actor counts to simulate in turn")
    parser.add_argument("--plot", help="with --sweep: write a PNG of utilisation and lag")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--model", choices=("aggregated", "fine"), help="spec: model")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec key, e.g. --set actors.count=500")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    overrides = list(args.set)
    if args.duration is not None:
        overrides.append(f"duration_s={args.duration!r}")
    if args.model is not None:
        overrides.append(f"model={args.model}")
    try:
        spec = load_spec(args.spec, overrides)
        if args.plot and not args.sweep:
            raise ConfigError("--plot: needs --sweep (the actor counts to plot)")
        counts = _parse_actors(args.sweep) if args.sweep else None
    except ConfigError as error:
        print(f"headrace simulate: error: {error}", file=sys.stderr)
        return 2
    table = sys.stderr if args.json else sys.stdout
    if counts is None:
        result = simulate(spec, args.seed)
        print(format_report(result), file=table)
    else:
        points = sweep(spec, counts, args.seed)
        if args.plot:
            plot_sweep(points, args.plot)
        print(format_sweep(points), file=table)
        result = {"sweep": points, "plot": args.plot}
    if args.json:
        print(json.dumps(_json_safe(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
