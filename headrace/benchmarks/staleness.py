"""`headrace bench staleness`: does learning hold up when actors act with k-version-old weights?

    headrace bench staleness [--quick] [--json] [--seeds 5] [--lag-updates 0,8,16,32 | --lags K,..]
                             [--corrections none,truncated_is,ppo_clip,decoupled,dppo_mask,m2po]
                             [--steps N]
                             [--eval-every N] [--margin 0] [--target-lag 4] [--lr 3e-4]
                             [--rho-max 2] [--level token] [--out DIR]

Trains guess_number (N=16, T=4) once per (lag k, correction, seed), one run after another, through
the code path `headrace train` takes (`runtime.threads.train` on a config built by
`headrace.config.load(data=...)`). Every run has the same model, batch, optimizer and number of
learner steps (`run.max_steps`, fixed in advance); only these keys differ:

- `staleness.forced_lag = k`: actors act with the weights k versions behind the newest;
- `staleness.max_policy_lag = k + margin`: the admission limit and the learner's gate. With
  `margin` 0 (the default) and `publish_every` 1, admission lets actors start exactly one batch of
  groups beyond what the learner holds, so every group is trained exactly k versions after the
  weights that generated it (once the learner is past version k): lag_mean reads k, not k plus
  queueing noise, and k = 0 is on-policy. A margin m lets actors run m batches further ahead
  (more overlap, lag between k and k + m);
- `learner.loss.kind`: the off-policy correction (none, truncated_is, ppo_clip, decoupled,
  dppo_mask, m2po);
- `run.seed`: model initialisation, tasks and sampling (the same seed gives every (k, correction)
  the same initial weights and task stream).

Per run, from its summary.json and metrics.jsonl:
  final_success_rate  greedy success of the final weights over the 16 secrets (summary.json);
  success_auc         mean of the periodic greedy evaluations (`run.eval_every`) before the last
                      step; the final evaluation is not among them;
  lag_mean            mean of the `staleness/lag_mean` records once the learner is past version k
                      (before that the actors' weights are version 0 and the lag is smaller);
  dropped_lag, dropped_age  the gate's drop counters (`staleness/dropped_lag`, `.../dropped_age`)
                      at the end of the run;
  is_ess              mean of the `is/ess` records (normalised effective sample size of the
                      importance ratios current/behaviour over loss tokens; 1 = on-policy).
Lags: `--lags` counts learner versions k; `--lag-updates` counts optimizer updates, the unit
that says how far the policy moved (each version is `UPDATES_PER_VERSION` = publish_every x
minibatches x epochs = 2 updates here), so 8, 16, 32 updates are k = 4, 8, 16. Every row prints
both (`lag`, `lag_updates`).

The summary has, per (k, correction), the means over seeds, their spread (`*_std`, `*_min`,
`*_max` over seeds) and `final_ratio` / `auc_ratio`: the ratio of those means to the k = 0 means
of the same correction. `targets` says whether, at the target lag (4), truncated_is and decoupled
reach >= 95 % of k = 0 on both figures; `largest_kept_lag` is the largest lag at which some
correction keeps both ratios >= 95 % (and which corrections do).

Ctrl-C stops the current run cleanly (it is evaluated and reported as interrupted) and skips the
rest; what finished is still reported. docs/staleness.md explains how to read the result.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import tempfile
import time
from typing import Any

from headrace import benchlib
from headrace.metrics.records import read_records

CORRECTIONS = ("none", "truncated_is", "ppo_clip", "decoupled", "dppo_mask", "m2po")
TARGET_CORRECTIONS = ("truncated_is", "decoupled")
TARGET_RATIO = 0.95
GROUPS_PER_BATCH = 16  # 128 episodes per learner step (G = 8), two optimizer updates of 64
GROUP_SIZE = 8
MINIBATCHES = 2
UPDATES_PER_VERSION = MINIBATCHES  # publish_every 1, epochs 1: optimizer updates per version
DEFAULT_LAG_UPDATES = (0, 8, 16, 32)
DEFAULT_SEEDS = 5
# Calibration (docs/staleness.md, "Calibration"): the step size sets how far the policy moves per
# version, so how much a lag of k matters. At lr 3e-4, k = 0 (seeds 0-2, 480 steps) rose to 0.69-0.81
# by ~330-390 steps and stayed at 0.81 from there (the best possible is 15/16 = 0.94); 320 steps is
# where it has clearly learned and is still rising; about 40 s per run on an idle machine.
DEFAULT_STEPS = 320
DEFAULT_EVAL_EVERY = 20
DEFAULT_LR = 3e-4
DEFAULT_RHO_MAX = 2.0


def run_config(*, lag: int, correction: str, seed: int, steps: int, eval_every: int, margin: int,
               run_dir: pathlib.Path, max_wall_s: float, level: str = "token",
               lr: float = DEFAULT_LR, rho_max: float = DEFAULT_RHO_MAX) -> dict[str, Any]:
    """The run's config as a plain mapping (for `headrace.config.load(data=...)`)."""
    in_flight_groups = GROUPS_PER_BATCH * (margin + 1)  # the most admission lets run at once
    return {
        "run": {"dir": str(run_dir), "seed": seed, "max_steps": steps, "max_wall_s": max_wall_s,
                "eval_every": eval_every, "stop_at_target": False, "log_every": 1,
                "launcher": "threads"},
        "env": {"name": "guess_number", "kwargs": {"n": 16, "max_turns": 4, "turn_penalty": 0.01}},
        "model": {"preset": "tiny", "max_len": 64},
        "sampling": {"temperature": 1.0, "max_new_tokens": 1, "constrain_to_actions": True},
        "actor": {"num_actors": 1, "envs_per_actor": GROUP_SIZE * in_flight_groups,
                  "group_size": GROUP_SIZE, "max_batch": 512},
        "buffer": {"backend": "memory", "capacity": in_flight_groups,
                   "max_pending": 4 * in_flight_groups},
        "weights": {"backend": "memory"},
        "learner": {"groups_per_batch": GROUPS_PER_BATCH, "publish_every": 1,
                    "minibatches": MINIBATCHES,
                    "optimizer": {"lr": lr, "clip_norm": 1.0},
                    "loss": {"kind": correction, "rho_max": rho_max, "clip_eps": 0.2,
                             "dual_clip": 3.0, "level": level},
                    "advantage": "grpo", "entropy_coef": 0.03},
        "shapes": {"buckets": [4, 8, 12]},
        "staleness": {"max_policy_lag": lag + margin, "forced_lag": lag, "max_age_s": 0.0},
    }


def _mean(values: list[float]) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def read_run(run_dir: pathlib.Path, summary: dict[str, Any], lag: int) -> dict[str, Any]:
    """The run's figures (see the module docstring) from summary.json and metrics.jsonl.

    Raises:
      FileNotFoundError: the run wrote no metrics.jsonl.
    """
    records = read_records(run_dir)
    trained = [r for r in records if r.get("step", 0) >= 1]
    last = records[-1] if records else {}
    steady = [r["staleness/lag_mean"] for r in trained
              if r["step"] > lag and "staleness/lag_mean" in r]
    steps = int(summary.get("steps", 0))
    curve = summary.get("eval_curve", [])
    periodic = [p["success_rate"] for p in curve[:-1] if p["step"] < steps]
    return {
        "final_success_rate": summary["final_success_rate"] if summary["final_success_rate"]
        is not None else float("nan"),  # None: the run failed (its errors are in the row)
        "success_auc": _mean(periodic),
        "lag_mean": _mean(steady),
        "dropped_lag": int(last.get("staleness/dropped_lag", 0)),
        "dropped_age": int(last.get("staleness/dropped_age", 0)),
        "is_ess": _mean([r["is/ess"] for r in trained if "is/ess" in r]),
        "evals": len(periodic),
        "steps": steps,
        "wall_s": summary.get("wall_s"),
        "stopped_by": summary.get("stopped_by"),
    }


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (lag, correction): means over seeds, and the ratios to k = 0 of the same correction."""
    cells: dict[tuple[int, str], list[dict]] = {}
    for run in runs:
        cells.setdefault((run["lag"], run["correction"]), []).append(run)
    rows = []
    for (lag, correction), items in sorted(cells.items(), key=lambda kv: kv[0]):
        row: dict[str, Any] = {"lag": lag, "lag_updates": lag * UPDATES_PER_VERSION,
                               "correction": correction, "seeds": len(items)}
        for key in ("final_success_rate", "success_auc", "lag_mean", "is_ess", "dropped_lag",
                    "dropped_age"):
            row[key] = _mean([r[key] for r in items])
        for key in ("final_success_rate", "success_auc"):  # the spread over seeds
            values = [r[key] for r in items if r[key] is not None and math.isfinite(r[key])]
            row[f"{key}_std"] = (math.sqrt(sum((v - row[key]) ** 2 for v in values)
                                           / (len(values) - 1)) if len(values) > 1
                                 else float("nan"))
            row[f"{key}_min"] = min(values) if values else float("nan")
            row[f"{key}_max"] = max(values) if values else float("nan")
        rows.append(row)
    base = {r["correction"]: r for r in rows if r["lag"] == 0}
    for row in rows:
        ref = base.get(row["correction"])
        for key, name in (("final_success_rate", "final_ratio"), ("success_auc", "auc_ratio")):
            denominator = ref[key] if ref else float("nan")
            row[name] = row[key] / denominator if denominator and math.isfinite(
                denominator) else float("nan")
    return rows


def targets(rows: list[dict[str, Any]], lag: int) -> dict[str, Any]:
    """Whether truncated_is and decoupled keep >= 95 % of k = 0 on both figures at `lag`.

    `met` is None where the cell (or its k = 0 reference) was not measured.
    """
    out: dict[str, Any] = {"lag": lag, "threshold": TARGET_RATIO}
    for correction in TARGET_CORRECTIONS:
        row = next((r for r in rows if r["lag"] == lag and r["correction"] == correction), None)
        final = row["final_ratio"] if row else float("nan")
        auc = row["auc_ratio"] if row else float("nan")
        measured = math.isfinite(final) and math.isfinite(auc)
        out[correction] = {"final_ratio": final, "auc_ratio": auc,
                           "met": (final >= TARGET_RATIO and auc >= TARGET_RATIO)
                           if measured else None}
    return out


def largest_kept_lag(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest lag k > 0 at which some correction keeps final success and AUC >= 95 % of its
    own k = 0 (None when none does at any measured lag), with every correction that does."""
    kept: dict[int, list[str]] = {}
    for row in rows:
        if row["lag"] > 0 and all(math.isfinite(row[k]) and row[k] >= TARGET_RATIO
                                  for k in ("final_ratio", "auc_ratio")):
            kept.setdefault(row["lag"], []).append(row["correction"])
    if not kept:
        return {"lag": None, "lag_updates": None, "corrections": [], "threshold": TARGET_RATIO}
    lag = max(kept)
    return {"lag": lag, "lag_updates": lag * UPDATES_PER_VERSION, "corrections": kept[lag],
            "threshold": TARGET_RATIO}


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}={text!r}: a comma-separated list of integers, "
                                         "e.g. 0,4,16") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{what}={text!r}: need at least one, each >= 0")
    return values


def _corrections(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in values if v not in CORRECTIONS]
    if not values or unknown:
        raise argparse.ArgumentTypeError(
            f"--corrections={text!r}: unknown {', '.join(unknown) or '(empty)'}; choose from "
            f"{', '.join(CORRECTIONS)}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="headrace bench staleness",
                                     description=__doc__.split("\n\n")[0],
                                     parents=[benchlib.bench_parser()])
    parser.add_argument("--seeds", type=int, default=DEFAULT_SEEDS,
                        help="seeds 0..N-1 per (lag, correction)")
    lags = parser.add_mutually_exclusive_group()
    lags.add_argument("--lags", type=lambda t: _ints(t, "--lags"), default=None,
                      help="forced lags k in learner versions, comma-separated")
    lags.add_argument("--lag-updates", type=lambda t: _ints(t, "--lag-updates"), default=None,
                      help="forced lags in optimizer updates, comma-separated, each a multiple "
                           f"of {UPDATES_PER_VERSION} (the updates per version); default "
                           f"{','.join(map(str, DEFAULT_LAG_UPDATES))}")
    parser.add_argument("--corrections", type=_corrections, default=list(CORRECTIONS),
                        help="learner.loss.kind values, comma-separated")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"learner steps per run (default {DEFAULT_STEPS})")
    parser.add_argument("--eval-every", type=int, default=None,
                        help=f"steps between greedy evaluations (default {DEFAULT_EVAL_EVERY})")
    parser.add_argument("--margin", type=int, default=0,
                        help="staleness.max_policy_lag = k + margin (admission lets actors run "
                             "margin batches further ahead)")
    parser.add_argument("--target-lag", type=int, default=4, help="the lag the targets judge")
    parser.add_argument("--level", choices=("token", "sequence", "prefix"), default="token",
                        help="learner.loss.level of every run (where the importance ratio is "
                             "taken: per token, per sequence, or per decision)")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR,
                        help="learner.optimizer.lr of every run (the step size sets how far the "
                             "policy moves per version, so how much a lag of k matters)")
    parser.add_argument("--rho-max", type=float, default=DEFAULT_RHO_MAX,
                        help="learner.loss.rho_max of every run (where truncated_is and decoupled "
                             "cap their importance weights)")
    parser.add_argument("--max-wall-s", type=float, default=None,
                        help="safety cap per run in seconds, default 900 (600 with --quick, "
                             "where the step count ends each run); a capped run says so in "
                             "stopped_by")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="keep run folders (and result.json) here instead of a temp dir")
    args = parser.parse_args(argv)
    if args.lag_updates is not None:
        odd = [u for u in args.lag_updates if u % UPDATES_PER_VERSION]
        if odd:
            parser.error(f"--lag-updates {','.join(map(str, odd))}: each must be a multiple of "
                         f"{UPDATES_PER_VERSION} (a lag is whole versions of "
                         f"{UPDATES_PER_VERSION} updates)")
        args.lags = [u // UPDATES_PER_VERSION for u in args.lag_updates]
    elif args.lags is None:
        args.lags = [u // UPDATES_PER_VERSION for u in DEFAULT_LAG_UPDATES]
    if args.quick:  # seconds: 4 runs of a few steps each (what the tests use)
        args.seeds, args.lags = 1, [0, 2]
        args.corrections, args.target_lag = ["none", "truncated_is"], 2
        # 16 steps: three periodic evaluation points, so a learner that crosses several between
        # two reads of its step (half a second) still leaves at least one before the last step
        args.steps = 16 if args.steps is None else args.steps
        args.eval_every = 4 if args.eval_every is None else args.eval_every
        # a safety cap only: the step count ends each run (the cap counts start-up and compiles,
        # which on a loaded machine can take minutes, and a capped run falls short of its steps)
        args.max_wall_s = 600.0 if args.max_wall_s is None else args.max_wall_s
    args.steps = DEFAULT_STEPS if args.steps is None else args.steps
    args.eval_every = DEFAULT_EVAL_EVERY if args.eval_every is None else args.eval_every
    args.max_wall_s = 900.0 if args.max_wall_s is None else args.max_wall_s
    for name in ("seeds", "steps", "eval_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.margin < 0 or args.max_wall_s <= 0 or not args.lr > 0 or not args.rho_max >= 1:
        parser.error("--margin must be >= 0, --max-wall-s > 0, --lr > 0 and --rho-max >= 1")
    return args


def _table(rows: list[dict[str, Any]], title: str) -> None:
    """The summary as a table on stderr (means over seeds; ratios to k = 0)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, header_style="bold")
    columns = (("k", "lag", "{}"), ("updates", "lag_updates", "{}"),
               ("correction", "correction", "{}"), ("seeds", "seeds", "{}"),
               ("final", "final_success_rate", "{:.3f}"), ("±", "final_success_rate_std", "{:.3f}"),
               ("final/k0", "final_ratio", "{:.2f}"),
               ("auc", "success_auc", "{:.3f}"), ("±", "success_auc_std", "{:.3f}"),
               ("auc/k0", "auc_ratio", "{:.2f}"),
               ("lag", "lag_mean", "{:.2f}"), ("ess", "is_ess", "{:.3f}"),
               ("dropped", "dropped_lag", "{:.1f}"))
    for header, key, _ in columns:
        table.add_column(header, justify="left" if key == "correction" else "right")
    for row in rows:
        table.add_row(*["-" if row[key] is None or (isinstance(row[key], float)
                                                    and not math.isfinite(row[key]))
                        else fmt.format(row[key]) for _, key, fmt in columns])
    Console(file=sys.stderr, width=None if sys.stderr.isatty() else 120).print(table)


def _finite(value: Any) -> Any:
    """NaN and infinities as None (strict JSON has no spelling for them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def one_run(args, lag: int, correction: str, seed: int, root: pathlib.Path) -> dict[str, Any]:
    """Trains one (lag, correction, seed) and returns its row (blocking; 30-60 s by default)."""
    from headrace.config import load
    from headrace.runtime.threads import train

    run_dir = root / run_dir_name(lag, correction, seed)
    config = load(data=run_config(lag=lag, correction=correction, seed=seed, steps=args.steps,
                                  eval_every=args.eval_every, margin=args.margin,
                                  run_dir=run_dir, max_wall_s=args.max_wall_s, level=args.level,
                                  lr=args.lr, rho_max=args.rho_max))
    summary = train(config, live=False, t0=time.time())
    row = {"lag": lag, "lag_updates": lag * UPDATES_PER_VERSION, "correction": correction,
           "seed": seed, **read_run(run_dir, summary, lag)}
    if summary.get("errors"):
        row["errors"] = summary["errors"]
    return row


def run_dir_name(lag: int, correction: str, seed: int) -> str:
    return f"k{lag}-{correction}-s{seed}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = [(lag, correction, seed) for lag in args.lags for correction in args.corrections
            for seed in range(args.seeds)]
    if args.out is not None:  # metrics.jsonl is appended to: an old run would mix in
        taken = [name for name in (run_dir_name(*p) for p in plan) if (args.out / name).exists()]
        if taken:
            print(f"headrace bench staleness: --out {args.out} already holds {', '.join(taken)}; "
                  "choose an empty or new folder", file=sys.stderr)
            return 2
    runs: list[dict[str, Any]] = []
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="headrace-staleness-") as tmp:
        root = args.out or pathlib.Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        started = time.time()
        for i, (lag, correction, seed) in enumerate(plan):
            try:
                row = one_run(args, lag, correction, seed, root)
            except KeyboardInterrupt:
                interrupted = True
                break
            runs.append(row)
            print(f"[{i + 1}/{len(plan)}] k={lag} ({lag * UPDATES_PER_VERSION} updates) "
                  f"{correction} seed={seed}: final "
                  f"{row['final_success_rate']:.3f} auc {row['success_auc']:.3f} lag "
                  f"{row['lag_mean']:.2f} ess {row['is_ess']:.3f} dropped {row['dropped_lag']} "
                  f"({row['wall_s']} s, {row['stopped_by']})", file=sys.stderr, flush=True)
            if row["stopped_by"] == "interrupted":
                interrupted = True
                break
        rows = summarize(runs)
        result = {
            "runs": runs,
            "summary": rows,
            "targets": targets(rows, args.target_lag),
            "largest_kept_lag": largest_kept_lag(rows),
            "settings": {"env": "guess_number", "n": 16, "max_turns": 4, "steps": args.steps,
                         "eval_every": args.eval_every, "margin": args.margin,
                         "level": args.level, "lr": args.lr, "rho_max": args.rho_max,
                         "groups_per_batch": GROUPS_PER_BATCH, "group_size": GROUP_SIZE,
                         "updates_per_version": UPDATES_PER_VERSION,
                         "lags_updates": [k * UPDATES_PER_VERSION for k in args.lags],
                         "seeds": args.seeds, "lags": args.lags,
                         "corrections": args.corrections,
                         "wall_s": round(time.time() - started, 1)},
            "interrupted": interrupted,
        }
        result = _finite(result)
        if args.out is not None:
            (root / "result.json").write_text(json.dumps(result, indent=2))
    _table(rows, f"staleness: guess_number N=16 T=4, {args.steps} steps, "
                 f"{args.seeds} seed(s), margin {args.margin}")
    if args.json:
        sys.stdout.write(json.dumps(result, allow_nan=False) + "\n")
        sys.stdout.flush()
    return 130 if interrupted else (1 if any(r.get("errors") for r in runs) else 0)


if __name__ == "__main__":
    sys.exit(main())
