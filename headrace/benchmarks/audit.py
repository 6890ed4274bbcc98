"""`headrace bench audit`: does the latency audit predict what a pool really does?

In one run, in the utilisation benchmark's setting (`headrace bench utilization`: processes
launcher, the learner pinned to core 0, guess_number with a lognormal per-step latency, actors
keeping each episode's cache and compiling their sampling programs before the first episode;
`--no-keep-cache`, `--no-precompile` as there):

1. measure: one run at `--measure-envs` environments with every group traced, then the audit
   (`headrace.audit.audit.analyze`) of its run folder: stage distributions, Little's law, the
   recommended pool (actors x environments per actor);
2. predict, from that measurement only, pools of 0.25x, 1x and 2x the recommended size;
3. run each of those pools for real (the same `headrace train` machinery) and measure learner
   utilisation and mean policy lag over the same steady-state window length.

Prints `{"points": [{"actors", "envs_per_actor", "measured_utilization", "predicted_utilization",
"measured_lag_mean", "predicted_lag_mean"}...], "recommendation": {...}, "targets": {...}}`.
Targets: |predicted - measured| utilisation <= 0.05 and lag within 25 % at every point; the
recommended (1x) pool reaches utilisation >= 0.95.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
import tempfile

from headrace import benchlib
from headrace.metrics.records import read_records

MULTIPLIERS = (0.25, 1.0, 2.0)
QUICK_GROUPS = 16  # --quick: pools of at most this many groups at 1x


def _utilization_bench():
    """The utilisation benchmark: the setting this benchmark shares (one definition of it)."""
    from headrace.benchmarks import utilization

    return utilization


def window_figures(run_dir: pathlib.Path, window_s: float) -> dict:
    """Utilisation and mean lag over [first trained step, + window_s] from metrics.jsonl."""
    records = read_records(run_dir)
    trained = [r for r in records if r.get("learner/step", 0) >= 1]
    if not trained:
        return {"utilization": 0.0, "lag_mean": None, "window_s": 0.0, "steps": 0}
    first = trained[0]["time"]  # the first step's record (learner/utilization counts from it)
    inside = [r for r in trained if r["time"] - first <= window_s] or trained[:1]
    last = inside[-1]
    lags = [r["staleness/lag_mean"] for r in inside if "staleness/lag_mean" in r]
    return {"utilization": last.get("learner/utilization", 0.0),
            "lag_mean": sum(lags) / len(lags) if lags else None,
            "window_s": last["time"] - first, "steps": last.get("learner/step", 0)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headrace bench audit", description=__doc__,
                                     parents=[benchlib.bench_parser()])
    util = _utilization_bench()
    util.add_workload_args(parser)
    parser.add_argument("--duration", type=float, default=60.0,
                        help="steady-state seconds measured per run")
    parser.add_argument("--measure-envs", type=int, default=1024,
                        help="environments of the measurement run (a small pool spreads an "
                             "actor's fixed CPU per second over few turns, so the audit "
                             "overprices a turn; docs/audit.md)")
    parser.add_argument("--max-policy-lag", type=int, default=0,
                        help="the staleness limit of every run (default: per run, the limit that "
                             "admits its pool, as in `headrace bench utilization`)")
    parser.add_argument("--out", default="",
                        help="keep each run's folder (measure, x0.25, x1.0, x2.0) under this "
                             "folder (default: a temporary one, removed)")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--headroom", type=float, default=1.2)
    args = parser.parse_args(argv)
    util.settle_workload_args(args)
    if args.quick:
        args.env_latency, args.duration, args.groups_per_batch = 0.05, 4.0, 4
        args.warmup_allowance, args.measure_envs = 15.0, 32
        args.d_model, args.n_layers = 64, 2
    from headrace.audit import audit
    from headrace.runtime.audit import with_probe

    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[1:])  # core 0 is the learner's
    with (contextlib.nullcontext(args.out) if args.out
          else tempfile.TemporaryDirectory(prefix="headrace-bench-audit-")) as tmp:
        root = pathlib.Path(tmp)

        def limits(envs: int) -> tuple[int, int]:
            """(max_policy_lag, buffer capacity) of a pool of `envs` environments."""
            return audit.admitting_limits(envs, 8, args.groups_per_batch, args.max_policy_lag)

        def run(name: str, actors: int, envs: int, trace_rate: float,
                settings: dict | None = None) -> pathlib.Path:
            data = util.base_config(args, root / name)
            data["run"].update(trace_rate=trace_rate, **(settings or {}))
            data["staleness"]["max_policy_lag"], data["buffer"]["capacity"] = limits(
                actors * envs)
            if args.quick:  # a smoke run: one process starts in seconds, not tens of seconds
                data["run"].update(launcher="threads", learner_cpus=[], actor_cpus=[])
                data["buffer"]["backend"] = data["weights"]["backend"] = "memory"
            data["actor"].update(num_actors=actors, envs_per_actor=envs)
            util.run_training(data)
            return root / name

        # Quick: the measurement stops by steps, since a loaded machine may start slowly.
        measured_dir = run("measure", 1, args.measure_envs, 1.0,
                           {"max_steps": 6, "max_wall_s": 120.0} if args.quick else {})
        m = with_probe(audit.read_run(measured_dir))
        # A smoke run's six-step measurement sizes nothing real: keep its pools small.
        report = audit.analyze(measured_dir, target=args.target, headroom=args.headroom,
                               duration_s=args.duration, plot=False,
                               admit_pool=not args.max_policy_lag, measured=m,
                               max_envs=8 * QUICK_GROUPS if args.quick else None,
                               progress=lambda line: print(f"headrace bench audit: {line}",
                                                           file=sys.stderr, flush=True))
        rec = report["recommendation"]
        cap = rec["envs_per_actor_cap"]
        total = rec["actors"] * rec["envs_per_actor"]
        points = []
        for factor in MULTIPLIERS:
            actors, per = audit.split_pool(int(total * factor), cap, m.group_size)
            # The prediction comes from the measurement run alone, before this pool runs.
            predicted = audit.predict(m, actors, per, args.duration + m.group_latency_s,
                                      limits=limits(actors * per))
            real = window_figures(run(f"x{factor}", actors, per, 0.01), args.duration)
            points.append({
                "factor": factor, "actors": actors, "envs_per_actor": per,
                "max_policy_lag": limits(actors * per)[0],
                "measured_utilization": real["utilization"],
                "predicted_utilization": predicted["learner_utilization"],
                "measured_lag_mean": real["lag_mean"],
                "predicted_lag_mean": predicted["staleness_lag_mean"],
                "measured_window_s": real["window_s"], "measured_steps": real["steps"]})
    for p in points:
        p["utilization_error"] = abs(p["predicted_utilization"] - p["measured_utilization"])
        lag_m, lag_p = p["measured_lag_mean"], p["predicted_lag_mean"]
        p["lag_error"] = (abs(lag_p - lag_m) / lag_m if lag_m else
                          (0.0 if not lag_p else None)) if lag_m is not None else None
    one = next(p for p in points if p["factor"] == 1.0)
    result = {
        "points": points,
        "measurement": {"envs": args.measure_envs, **report["measured"],
                        "stages": report["stages"], "rates": report["rates"],
                        "bottleneck": report["bottleneck"]},
        "recommendation": {k: rec[k] for k in ("actors", "envs_per_actor", "max_policy_lag",
                                               "predicted_utilization", "predicted_lag_mean")}
        | {"little": rec["little"], "envs_per_actor_cap": cap},
        "targets": {
            "utilization_within_0.05": all(p["utilization_error"] <= 0.05 for p in points),
            "lag_within_25pct": all(p["lag_error"] is not None and p["lag_error"] <= 0.25
                                    for p in points),
            "recommended_reaches_target": one["measured_utilization"] >= args.target},
        "settings": {"env_latency_s": args.env_latency, "duration_s": args.duration,
                     "groups_per_batch": args.groups_per_batch, "d_model": args.d_model,
                     "n_layers": args.n_layers, "epochs": args.epochs,
                     "max_policy_lag": args.max_policy_lag or "admits each pool",
                     "keep_cache": args.keep_cache, "precompile": args.precompile},
    }
    benchlib.emit(result, as_json=args.json, title="latency audit: predicted vs measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
