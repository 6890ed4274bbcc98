"""`headrace bench utilization`: learner utilisation of the same workload three ways, in one run.

- `learner_alone`: the learner process fed from a pre-filled Redis buffer, no actors (the ceiling);
- `sync`: `run.mode: sync` through the processes launcher (actors generate one batch at the
  learner's version, the learner trains and publishes, then waits again);
- `async`: the default decoupled mode through the processes launcher, no pre-filled buffer, its
  environment pool sized by Little's law from the ceiling's consume rate and the measured episode
  latency.

Same model, batch, updates per trajectory and CPU placement for all three: the learner pinned to
core 0 with one XLA thread, actors, Redis and the supervisor on the other cores. The environment is
guess_number with an injected per-step latency (`--env-latency`, lognormal), so an episode takes
several seconds. Every way runs the code path a user's run takes (`headrace train` machinery).
Actors keep each episode's keys and values between turns (`sampling.keep_cache`) and compile every
sampling program before their first episode (`sampling.precompile`, counted in `warmup_s`): one
actor core then produces faster than the learner core trains (docs/runtime.md).

Learning is measured in the same runs: every way evaluates its learner's weights greedily on the
fixed task set (all N secrets of guess_number, `--secrets` N and `--max-turns` T: 16 and 4, a task
learnt within the window) every `--eval-every` steps (`run.eval_every`, the evaluator every
`headrace train` runs), for `--seeds` seeds, and reports the curve of the seed mean at equal
optimizer updates (`eval_curve`), the time to `--target` and the lag it trained at in versions and
in optimizer updates. Sync always trains on fresh data, so its success per update does not depend on
the environment's latency: its curve comes from runs without injected latency (same seeds and
settings) and its time to target from that curve's updates times the step period sync measured with
latency (`figures_from` says which figure comes from which run). The bench exits 1 when async's
curve falls below `--learning-floor` x sync's at some point past the first quarter (it trained at
a lag its learning does not survive), or when sync's curve rose too little for a comparison
(learning not visible in the window), unless `--quick`. `learning_auc_ratio` compares the curves'
areas over the same points; `--noise-check` runs sync's curve runs a second time and compares the
two the same way, which says how far apart chance alone puts them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import sys
import tempfile
import threading
import time
import typing

from headrace import benchlib
from headrace.audit.audit import admitting_limits, warmup_allowance_s
from headrace.benchmarks._curves import compare, lag_figures, mean_curve, sync_rise, time_to_target
from headrace.config import LossConfig, load
from headrace.metrics.records import read_records

# Learning inside the bench: the greedy evaluation target, the seeds each curve point is the mean
# of, and how close async's curve must stay to sync's past the first quarter (docs/runtime.md).
TARGET = 0.9
SEEDS = 3
LEARNING_FLOOR = 0.95

PLACEMENT = {"learner_cpus": [0], "actor_cpus": []}
SIGMA = 0.25  # the env latency's lognormal sigma
# The task: guess_number with N secrets and T turns. This bench's default, N = 16 and T = 4 (the
# staleness bench's task), shows learning within its window: the default model goes from 0.25 to
# ~0.7 greedy in ~120 updates on fresh data. At N = 32, T = 5 (`headrace bench audit`'s default)
# it stays near chance for the ~350 updates of a 120 s window (docs/runtime.md).
SECRETS, TURNS = 16, 4
# The verdict needs learning to compare: sync's curve must rise by at least this past its first
# point, or neither way has learned enough in the window for their ratio to mean anything.
MIN_RISE = 0.2
TURN_INFERENCE_S = 0.1  # a turn's wait for its batched policy call, on top of the env step
QUICK_STEPS = 8
QUICK_GROUPS = 16  # --quick: the async pool's groups


def base_config(args, run_dir: pathlib.Path) -> dict:
    """The shared workload: model, batch and updates per trajectory are the same for all ways."""
    quick = args.quick
    return {
        # The window is the `duration` seconds from the first trained batch; start-up (spawning,
        # compiling) is reported as warmup_s and given its own allowance.
        "run": {"dir": str(run_dir), "max_train_s": 0.0 if quick else args.duration,
                "max_wall_s": args.duration + args.warmup_allowance,
                # --quick (a smoke run for the tests) stops by steps, not by the clock
                "max_steps": QUICK_STEPS if quick else 0,
                # greedy evaluations: this bench's; `headrace bench audit` measures none
                "eval_every": getattr(args, "eval_every", 0),
                "eval_target": TARGET, "stop_at_target": False,
                "log_every": 1, "launcher": "processes", **PLACEMENT,
                "checkpoint_every": 0},  # the pipeline alone, as measured before checkpoints
        "env": {"name": "guess_number",
                "kwargs": {"n": args.secrets, "max_turns": args.max_turns},
                "latency": {"kind": "lognormal", "seconds": args.env_latency, "sigma": SIGMA},
                "step_timeout_s": max(30.0, 20 * args.env_latency)},
        "model": {"preset": "custom", "d_model": 64 if quick else args.d_model,
                  "n_layers": 2 if quick else args.n_layers, "n_heads": 4, "n_kv_heads": 2,
                  "d_ff": 128 if quick else 4 * args.d_model, "max_len": 64},
        "sampling": {"max_new_tokens": 1, "keep_cache": args.keep_cache,
                     "precompile": args.precompile},
        "actor": {"num_actors": 1, "envs_per_actor": 64, "group_size": 8, "max_batch": 1024},
        "buffer": {"backend": "redis", "capacity": 4 * args.groups_per_batch,
                   "max_pending": 16 * args.groups_per_batch},
        "weights": {"backend": "dir"},
        "learner": {"groups_per_batch": args.groups_per_batch, "minibatches": 1,
                    "epochs": args.epochs, "publish_every": 1, "entropy_coef": 0.03,
                    "optimizer": {"lr": args.lr, "clip_norm": 1.0},
                    "loss": {"kind": args.loss}},
        "shapes": {"buckets": [4, 8, 12]},
        "staleness": {"max_policy_lag": args.max_policy_lag or 4},
    }


def read_run(run_dir: pathlib.Path, start: float, updates_per_version: int = 1) -> dict:
    """Figures of one way from its run folder (metrics.jsonl, summary.json)."""
    records = read_records(run_dir)
    trained = [r for r in records if r.get("step", 0) >= 1]
    last = records[-1]
    first_time = trained[0]["time"] if trained else float("nan")
    in_flight = [r["actor/in_flight"] for r in trained if "actor/in_flight" in r]
    ess = [r["is/ess"] for r in trained if "is/ess" in r]
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {
        "learner_utilization": last.get("learner/utilization", 0.0),
        "steps_per_s": last.get("learner/steps_per_s", 0.0),
        # over the steps' own window (steps that compiled left out), as steps_per_s
        "trajectories_per_s": (last.get("learner/steps_per_s", 0.0)
                               * last.get("learner/trajectories", 0.0) / last["step"]
                               if last.get("step") else 0.0),
        "updates_per_trajectory": last.get("learner/updates_per_trajectory", 0.0),
        **lag_figures(trained, updates_per_version),
        "in_flight_mean": sum(in_flight) / len(in_flight) if in_flight else 0.0,
        "dropped_lag": int(last.get("staleness/dropped_lag", 0)),  # groups the gate dropped
        "dropped": {"lag": int(last.get("staleness/dropped_lag", 0)),
                    "age": int(last.get("staleness/dropped_age", 0))},
        "is_ess": sum(ess) / len(ess) if ess else float("nan"),
        "warmup_s": first_time - start,
        "steps": last.get("step", 0),
        "episode_s_mean": last.get("actor/episode_s_mean", float("nan")),
        "step_s_p50": last.get("learner/step_s_p50", float("nan")),
        "final_success": summary.get("final_success_rate"),
        # the periodic greedy evaluations (the final one, at whatever step the run stopped, is
        # final_success): step, seconds since the run's start, success
        "evals": [p for p in summary.get("eval_curve", [])
                  if p["step"] < summary.get("steps", 0)],
    }


def run_training(data: dict, updates_per_version: int = 1) -> dict:
    from headrace.runtime import train

    start = time.time()
    with benchlib.StealClock(data["run"]["learner_cpus"]) as clock:
        train(load(data=data), live=False, t0=start)
    figures = read_run(pathlib.Path(data["run"]["dir"]), start, updates_per_version)
    first = start + figures["warmup_s"]
    figures["steal_s"] = clock.stolen_s(first, first + data["run"]["max_train_s"]
                                        if data["run"]["max_train_s"] else time.time())
    return figures


def learner_alone(args, run_dir: pathlib.Path) -> dict:
    """The learner process alone, over a buffer pre-filled by a real actor (no env latency)."""
    from headrace.buffer.server import RedisServer
    from headrace.metrics.core import Metrics
    from headrace.metrics.remote import read as read_metrics
    from headrace.runtime import build
    from headrace.runtime.processes import Supervisor
    from headrace.runtime.supervise import Evaluator, start_thread

    data = base_config(args, run_dir)
    data["env"]["latency"] = {"kind": "none"}
    steps = max(5, int(args.duration / 0.05))  # more groups than the learner can eat in time
    groups = min(steps * args.groups_per_batch, args.prefill_groups)
    data["buffer"]["capacity"] = groups
    data["buffer"]["max_pending"] = max(groups, data["buffer"]["max_pending"])
    data["staleness"]["max_policy_lag"] = 1_000_000  # pre-filled data is old by design
    config = load(data=data)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_id = "alone"
    with RedisServer.from_config(config.buffer, run_dir / "redis") as server:
        buffer = build.make_buffer(config, url=server.url, run_id=run_id, consumer="prefill")
        weights = build.make_weights(config, run_dir)
        task = build.build_task(config)
        graphdef, params = build.init_params(config, task)
        from headrace.model import params as params_lib

        weights.publish(params_lib.to_host(params), 0)
        stop = threading.Event()
        actor = build.make_actor(config, task, "prefill",
                                 build.make_sampler(config, task, graphdef, seed=1), buffer,
                                 weights, Metrics(), stop)
        filler = threading.Thread(target=actor.run)
        filler.start()
        while buffer.depth() < groups:
            time.sleep(0.2)
        stop.set()
        filler.join(timeout=60)
        supervisor = Supervisor(config, run_dir, server.url, run_id)
        start = time.time()
        # The evaluator `headrace train` runs (supervise.Evaluator), on the supervisor's cores:
        # it plays the learner's pinned weights of every run.eval_every-th step.
        evaluator = Evaluator(config, task, graphdef, weights, Metrics(), start, lambda: 0.0,
                              build.make_pins(config, run_dir))
        evaluating = start_thread("evaluator", evaluator.run)
        supervisor.start_learner()
        first = None
        metrics: dict = {}
        # --quick stops at its steps (the learner process exits at run.max_steps): the window
        # after the first step is then only a cap, as long as the start-up's (a loaded machine
        # may take more than `duration` to the evaluation pins the curve needs)
        window_s = args.warmup_allowance if args.quick else args.duration
        with benchlib.StealClock(config.run.learner_cpus) as clock:
            try:
                while time.time() - (first or start) < (window_s if first else
                                                         args.duration + args.warmup_allowance):
                    time.sleep(0.5)
                    metrics = read_metrics(server.client(), run_id)
                    if first is None and metrics.get("learner/step", 0) >= 1:
                        first = time.time()
                    evaluator.maybe_request(int(metrics.get("learner/step", 0)))
                    if supervisor.learner.process.exitcode is not None:
                        break
            finally:
                window_end = time.time()
                supervisor.stop()
                evaluating.stop(timeout_s=120)
        metrics = read_metrics(server.client(), run_id)
        evaluator.drain(int(metrics.get("learner/step", 0)))
        buffer.close()
    warmup_s = (first or float("nan")) - start
    return {
        "learner_utilization": metrics.get("learner/utilization", 0.0),
        "steps_per_s": metrics.get("learner/steps_per_s", 0.0),
        "trajectories_per_s": metrics.get("learner/steps_per_s", 0.0) * args.groups_per_batch * 8,
        "updates_per_trajectory": metrics.get("learner/updates_per_trajectory", 0.0),
        # its data are the initial policy's, by design: its lag is its step (the gate is off),
        # and its curve is learning from data that never get fresher
        **dict.fromkeys(lag_figures([], 1), math.nan),
        "in_flight_mean": 0.0,
        "dropped_lag": int(metrics.get("staleness/dropped_lag", 0)),
        "dropped": {"lag": int(metrics.get("staleness/dropped_lag", 0)),
                    "age": int(metrics.get("staleness/dropped_age", 0))},
        "is_ess": metrics.get("is/ess", float("nan")),
        "evals": sorted(evaluator.curve, key=lambda p: p["step"]),
        "warmup_s": warmup_s,
        "steps": metrics.get("learner/step", 0),
        "step_s_p50": metrics.get("learner/step_s_p50", float("nan")),
        "prefilled_groups": groups,
        "steal_s": clock.stolen_s(first, window_end) if first else 0.0,
    }


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload's settings (`base_config`), shared with `headrace bench audit`."""
    parser.add_argument("--env-latency", type=float, default=2.0, help="seconds per env step")
    parser.add_argument("--groups-per-batch", type=int, default=16,
                        help="groups per learner step (16: a step of ~0.3 s with the default "
                             "model)")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=1,
                        help="learner.epochs: passes over each batch (updates per trajectory)")
    parser.add_argument("--keep-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="sampling.keep_cache: actors keep each episode's cache between turns "
                             "(--no-keep-cache: each turn recomputes its whole context)")
    parser.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=True,
                        help="sampling.precompile: actors compile every sampling program before "
                             "their first episode (--no-precompile: as shapes appear, in the "
                             "background, while compiled programs serve)")
    parser.add_argument("--warmup-allowance", type=float, default=None,
                        help="seconds allowed for start-up before the measured window (default "
                             "150 with --precompile, whose compiles are start-up, else 60)")
    parser.add_argument("--secrets", type=int, default=32,
                        help="guess_number's env.kwargs.n: the secret is one of 1..N")
    parser.add_argument("--max-turns", type=int, default=5,
                        help="guess_number's env.kwargs.max_turns: guesses per episode")
    parser.add_argument("--lr", type=float, default=1e-3, help="learner.optimizer.lr")
    parser.add_argument("--loss", default="ppo_clip",
                        choices=typing.get_args(typing.get_type_hints(LossConfig)["kind"]),
                        help="learner.loss.kind (the off-policy correction)")


def settle_workload_args(args: argparse.Namespace) -> None:
    """Defaults that depend on other flags: a smoke run (--quick) compiles programs as shapes
    appear (a cold cache in CI); the warm-up allowance covers precompiling."""
    if args.quick:
        args.precompile = False
    if args.warmup_allowance is None:
        args.warmup_allowance = warmup_allowance_s(args.precompile)


def way(args, name: str, data: dict, root: pathlib.Path, seeds: int, updates: int) -> dict:
    """`seeds` runs of one way (seed 0 first); the figures of seed 0, the seed-mean curve and
    every seed's utilisation and rate."""
    runs = []
    for seed in range(seeds):
        seeded = json.loads(json.dumps(data))
        seeded["run"]["seed"] = seed
        seeded["run"]["dir"] = str(root / f"{name}-s{seed}")
        runs.append(run_training(seeded, updates))
    return seeded_figures(runs, updates, args.target)


def seeded_figures(runs: list[dict], updates: int, target: float) -> dict:
    """Seed 0's figures with the learning of all seeds: `eval_curve` (the seed mean per point),
    `time_to_target_s` on it, and the per-seed utilisation and rate."""
    figures = {k: v for k, v in runs[0].items() if k != "evals"}
    figures["eval_curve"] = mean_curve(runs, updates)
    # points some seed lacks (its evaluator fell behind and evaluated a newer pin instead)
    figures["eval_points_left_out"] = sum(len(r["evals"]) for r in runs) - len(runs) * len(
        figures["eval_curve"])
    figures["time_to_target_s"] = time_to_target(figures["eval_curve"], target)
    figures["seeds"] = len(runs)
    figures.update({f"seed_{name}": [r[key] for r in runs] for name, key in (  # every seed's
        ("utilization", "learner_utilization"), ("steps_per_s", "steps_per_s"),
        ("final_success", "final_success"), ("dropped", "dropped"))})
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headrace bench utilization", description=__doc__,
                                     parents=[benchlib.bench_parser()])
    add_workload_args(parser)
    parser.set_defaults(secrets=SECRETS, max_turns=TURNS)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per way")
    parser.add_argument("--out", default="",
                        help="keep each way's run folder under this folder (default: a temporary "
                             "one, removed)")
    parser.add_argument("--max-policy-lag", type=int, default=0,
                        help="the staleness limit of sync and async (default: the smallest that "
                             "admits the in-flight groups Little's law calls for)")
    parser.add_argument("--max-ready-batches", type=int, default=0,
                        help="staleness.max_ready_batches of async: admit a group only if at "
                             "most this many batches will be ahead of it when done (0: off)")
    parser.add_argument("--prefill-groups", type=int, default=8192)
    parser.add_argument("--eval-every", type=int, default=None,
                        help="learner steps between greedy evaluations (run.eval_every; default "
                             "40, 2 with --quick)")
    parser.add_argument("--seeds", type=int, default=None,
                        help=f"seeds per way each curve point is the mean of (default {SEEDS}, "
                             "1 with --quick)")
    parser.add_argument("--target", type=float, default=TARGET,
                        help="the greedy success time_to_target_s is measured to")
    parser.add_argument("--learning-floor", type=float, default=LEARNING_FLOOR,
                        help="exit 1 when async's success falls below this times sync's at a "
                             "curve point past the first quarter (not with --quick)")
    parser.add_argument("--noise-check", action="store_true",
                        help="run sync's curve runs a second time (same seeds and settings) and "
                             "report the learning figures between the two: how far apart two "
                             "runs of the same on-policy learning land (`noise`)")
    args = parser.parse_args(argv)
    settle_workload_args(args)
    args.seeds = args.seeds or (1 if args.quick else SEEDS)
    if args.eval_every is None:
        args.eval_every = 2 if args.quick else 40
    if args.quick:
        args.env_latency, args.duration, args.groups_per_batch = 0.05, 5.0, 4
        # The allowance only caps a run that is slow to start (a quick run stops at its steps):
        # on a loaded 2-core machine the async way took over 35 s to its first step.
        args.prefill_groups, args.warmup_allowance = 64, 300.0
        args.d_model, args.n_layers = 64, 2
    if min(args.epochs, args.groups_per_batch, args.seeds, args.eval_every, args.max_turns) < 1 \
            or args.secrets < 2 or min(args.env_latency, args.max_ready_batches) < 0:
        parser.error("--epochs, --groups-per-batch, --seeds, --eval-every and --max-turns must "
                     "be >= 1, --secrets >= 2, --env-latency and --max-ready-batches >= 0")
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[1:])  # core 0 is the learner's
    updates = args.epochs  # optimizer updates per learner step (and version: publish_every 1)
    with (contextlib.nullcontext(args.out) if args.out
          else tempfile.TemporaryDirectory(prefix="headrace-bench-")) as tmp:
        root = pathlib.Path(tmp)
        alone = learner_alone(args, root / "alone")
        consume_groups_per_s = alone["steps_per_s"] * args.groups_per_batch
        # Little's law: groups in flight = consume rate x group latency. A minute of training
        # leaves most episodes at their full T turns; a turn is a lognormal env step (mean
        # median x exp(sigma^2 / 2)) plus its wait for a batched policy call.
        episode_s = args.max_turns * (args.env_latency * math.exp(SIGMA**2 / 2) + TURN_INFERENCE_S)
        needed = consume_groups_per_s * episode_s
        # 2x with the ready cap, which then bounds what is in flight: the pool must never bind, and
        # a group outlasts this estimate (its slowest episode, turns queued on a busy actor).
        headroom = 2.0 if args.max_ready_batches else 1.25
        slots = max(1, math.ceil(needed * headroom))
        if args.quick:  # a smoke run: a pool that starts in seconds (its few steps, most of
            slots = QUICK_GROUPS  # them compiling, measure no steady rate to size one from)
        # The staleness limit and buffer that admit the pool (`audit.admitting_limits`).
        args.max_policy_lag, capacity = admitting_limits(8 * slots, 8, args.groups_per_batch,
                                                         args.max_policy_lag)
        async_data = base_config(args, root / "async")
        # max_batch stays 1,024: a call over thousands of episodes would hold each of them for
        # its whole length; a large turn is served by several calls instead.
        async_data["actor"]["envs_per_actor"] = 8 * slots
        async_data["buffer"]["capacity"] = capacity
        async_data["staleness"]["max_ready_batches"] = args.max_ready_batches
        result_async = way(args, "async", async_data, root, args.seeds, updates)
        sync_data = base_config(args, root / "sync")
        sync_data["run"]["mode"] = "sync"
        sync_data["actor"]["envs_per_actor"] = 8 * max(args.groups_per_batch, 1)
        sync = run_training(sync_data, updates)  # seed 0 with latency: utilisation, step period
        # Sync's curve: the same seeds and settings without injected latency (its success per
        # update does not depend on it), as far as async's curve reached.
        curve_data = json.loads(json.dumps(sync_data))
        curve_data["env"]["latency"] = {"kind": "none"}
        reach = max([p["updates"] for p in result_async["eval_curve"]] or [args.eval_every])
        curve_data["run"].update(max_steps=max(QUICK_STEPS if args.quick else 1,
                                               math.ceil(reach / updates)),
                                 max_train_s=0.0,
                                 max_wall_s=args.warmup_allowance + 4 * args.duration)
        sync_curve = way(args, "sync-curve", curve_data, root, args.seeds, updates)
        # The same runs again: runs are not bit-reproducible (thread timing decides which groups
        # make each batch), so this is a second draw of the same on-policy learning.
        again = (way(args, "sync-curve-again", curve_data, root, args.seeds, updates)
                 if args.noise_check else None)
    sync.update({k: sync_curve[k] for k in ("eval_curve", "seeds", "seed_final_success",
                                            "eval_points_left_out")})
    sync.pop("evals")
    sync["curve_step_period_s"] = 1 / sync["steps_per_s"] if sync["steps_per_s"] else None
    at_target = next((p["updates"] for p in sync["eval_curve"] if p["success"] >= args.target),
                     None)
    sync["time_to_target_s"] = (at_target / updates * sync["curve_step_period_s"]
                                if at_target is not None and sync["curve_step_period_s"]
                                else None)
    learning = compare(result_async["eval_curve"], sync["eval_curve"])
    ratio_min = learning["learning_ratio_min"]
    ttt = (result_async["time_to_target_s"] / sync["time_to_target_s"]
           if result_async["time_to_target_s"] is not None and sync["time_to_target_s"]
           else None)
    rise = sync_rise(sync["eval_curve"], learning["learning_ratios"])
    noise = (None if again is None else
             {"eval_curve": again["eval_curve"], "seed_final_success": again["seed_final_success"],
              **compare(again["eval_curve"], sync["eval_curve"])})
    visible = rise is not None and rise >= MIN_RISE
    survives = visible and ratio_min >= args.learning_floor
    result = {
        "learner_alone": alone, "sync": sync, "async": result_async,
        **learning,
        "noise": noise,
        "time_to_target_ratio": ttt,
        "sync_rise": rise,
        "learning_visible": visible,
        "learning_survives_lag": survives,
        "figures_from": {
            "learner_alone": "one run (seed 0) over a buffer pre-filled by the initial policy, no "
                             "env latency; its curve learns from data that never get fresher",
            "async": f"{args.seeds} run(s) with the injected latency (seeds 0..); rates and lags "
                     "from seed 0, eval_curve the seed mean",
            "sync": "rates and lags from one run (seed 0) with the injected latency; eval_curve "
                    f"the seed mean of {args.seeds} run(s) without injected latency (same seeds "
                    "and settings, as many updates as async's curve reached); time_to_target_s "
                    "= the updates where that curve reaches the target x the step period "
                    "measured with latency",
            "time_to_target_s": "seconds from the first trained step (start-up is warmup_s)",
            "lag_updates": "lag in versions x optimizer updates per version (publish_every x "
                           "minibatches x epochs)",
            "noise": "with --noise-check: sync's curve runs again (same seeds and settings), "
                     "compared with the first as async is (null without it)",
        },
        "little": {"consume_groups_per_s": consume_groups_per_s, "episode_s": episode_s,
                   "in_flight_groups_needed": needed, "headroom": headroom,
                   "envs_per_actor_async": 8 * slots,
                   "max_policy_lag": args.max_policy_lag,
                   "max_ready_batches": args.max_ready_batches,
                   "admission_window_groups": capacity, "buffer_capacity_async": capacity},
        "settings": {"env_latency_s": args.env_latency, "duration_s": args.duration,
                     "groups_per_batch": args.groups_per_batch, "group_size": 8,
                     "d_model": args.d_model, "n_layers": args.n_layers,
                     "epochs": args.epochs, "keep_cache": args.keep_cache,
                     "precompile": args.precompile, "lr": args.lr, "loss": args.loss,
                     "secrets": args.secrets, "max_turns": args.max_turns,
                     "eval_every": args.eval_every, "seeds": args.seeds, "target": args.target,
                     "learning_floor": args.learning_floor, "noise_check": args.noise_check,
                     "learner_cpus": PLACEMENT["learner_cpus"]},
        "async_over_sync_steps": (result_async["steps_per_s"] / sync["steps_per_s"]
                                  if sync["steps_per_s"] else None),
        "async_over_alone_steps": (result_async["steps_per_s"] / alone["steps_per_s"]
                                   if alone["steps_per_s"] else None),
    }
    alone_curve = mean_curve([alone], updates)
    alone.pop("evals")
    alone.update(eval_curve=alone_curve, time_to_target_s=time_to_target(alone_curve, args.target),
                 seeds=1)
    benchlib.emit(result, as_json=args.json, title="learner utilisation: alone / sync / async")
    if not visible and not args.quick:
        print(f"headrace bench utilization: sync's success rose {rise} (< {MIN_RISE}) over "
              "the compared curve points: learning is not visible in this window, so the curves "
              "cannot say whether async keeps up; lengthen --duration or make the task easier "
              "(--secrets, --max-turns)", file=sys.stderr)
        return 1
    if not survives and not args.quick:
        print(f"headrace bench utilization: async trained at a lag of "
              f"{result_async['lag_updates_mean']:.1f} optimizer updates (p90 "
              f"{result_async['lag_updates_p90']:.1f}) and its learning did not keep up: "
              f"learning_ratio_min {ratio_min} < --learning-floor {args.learning_floor}"
              + (f" (two runs of sync: {noise['learning_ratio_min']})" if noise else ""),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
