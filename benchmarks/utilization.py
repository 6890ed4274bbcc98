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

from headrace import benchlib
from headrace.audit.audit import admitting_limits, warmup_allowance_s

PLACEMENT = {"learner_cpus": [0], "actor_cpus": []}
MAX_TURNS, SIGMA = 5, 0.25  # guess_number's turns per episode; the env latency's lognormal sigma
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
                "max_steps": QUICK_STEPS if quick else 0, "eval_every": 0,
                "log_every": 1, "launcher": "processes", **PLACEMENT},
        "env": {"name": "guess_number", "kwargs": {"n": 32, "max_turns": MAX_TURNS},
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
                    "epochs": args.epochs, "publish_every": 1, "entropy_coef": 0.03},
        "shapes": {"buckets": [4, 8, 12]},
        "staleness": {"max_policy_lag": args.max_policy_lag or 4},
    }


def read_run(run_dir: pathlib.Path, start: float) -> dict:
    """Figures of one way from its run folder (metrics.jsonl, summary.json)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r.get("step", 0) >= 1]
    last = records[-1]
    first_time = trained[0]["time"] if trained else float("nan")
    in_flight = [r["actor/in_flight"] for r in trained if "actor/in_flight" in r]
    return {
        "learner_utilization": last.get("learner/utilization", 0.0),
        "steps_per_s": last.get("learner/steps_per_s", 0.0),
        # over the steps' own window (steps that compiled left out), as steps_per_s
        "trajectories_per_s": (last.get("learner/steps_per_s", 0.0)
                               * last.get("learner/trajectories", 0.0) / last["step"]
                               if last.get("step") else 0.0),
        "updates_per_trajectory": last.get("learner/updates_per_trajectory", 0.0),
        "lag_mean": last.get("staleness/lag_mean", 0.0),
        "in_flight_mean": sum(in_flight) / len(in_flight) if in_flight else 0.0,
        "dropped_lag": int(last.get("staleness/dropped_lag", 0)),  # groups the gate dropped
        "warmup_s": first_time - start,
        "steps": last.get("step", 0),
        "episode_s_mean": last.get("actor/episode_s_mean", float("nan")),
        "step_s_p50": last.get("learner/step_s_p50", float("nan")),
    }


def run_training(data: dict) -> dict:
    from headrace.config import load
    from headrace.runtime import train

    start = time.time()
    with benchlib.StealClock(data["run"]["learner_cpus"]) as clock:
        train(load(data=data), live=False, t0=start)
    figures = read_run(pathlib.Path(data["run"]["dir"]), start)
    first = start + figures["warmup_s"]
    figures["steal_s"] = clock.stolen_s(first, first + data["run"]["max_train_s"]
                                        if data["run"]["max_train_s"] else time.time())
    return figures


def learner_alone(args, run_dir: pathlib.Path) -> dict:
    """The learner process alone, over a buffer pre-filled by a real actor (no env latency)."""
    from headrace.actor.actor import Actor
    from headrace.buffer.server import RedisServer
    from headrace.config import load
    from headrace.metrics.core import Metrics
    from headrace.metrics.remote import read as read_metrics
    from headrace.runtime import build
    from headrace.runtime.processes import Supervisor

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
        actor = Actor(config, "prefill", task.make_env, task.tokenizer,
                      build.make_sampler(config, task, graphdef, seed=1), buffer, weights,
                      Metrics(), stop)
        filler = threading.Thread(target=actor.run)
        filler.start()
        while buffer.depth() < groups:
            time.sleep(0.2)
        stop.set()
        filler.join(timeout=60)
        supervisor = Supervisor(config, run_dir, server.url, run_id)
        start = time.time()
        supervisor.start_learner()
        first = None
        metrics: dict = {}
        with benchlib.StealClock(config.run.learner_cpus) as clock:
            try:
                while time.time() - (first or start) < (args.duration if first else
                                                         args.duration + args.warmup_allowance):
                    time.sleep(0.5)
                    metrics = read_metrics(server.client(), run_id)
                    if first is None and metrics.get("learner/step", 0) >= 1:
                        first = time.time()
                    if supervisor.learner.process.exitcode is not None:
                        break
            finally:
                window_end = time.time()
                supervisor.stop()
        metrics = read_metrics(server.client(), run_id)
        buffer.close()
    return {
        "learner_utilization": metrics.get("learner/utilization", 0.0),
        "steps_per_s": metrics.get("learner/steps_per_s", 0.0),
        "trajectories_per_s": metrics.get("learner/steps_per_s", 0.0) * args.groups_per_batch * 8,
        "updates_per_trajectory": metrics.get("learner/updates_per_trajectory", 0.0),
        "lag_mean": 0.0,
        "in_flight_mean": 0.0,
        "dropped_lag": int(metrics.get("staleness/dropped_lag", 0)),
        "warmup_s": (first or float("nan")) - start,
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


def settle_workload_args(args: argparse.Namespace) -> None:
    """Defaults that depend on other flags: a smoke run (--quick) compiles programs as shapes
    appear (a cold cache in CI); the warm-up allowance covers precompiling."""
    if args.quick:
        args.precompile = False
    if args.warmup_allowance is None:
        args.warmup_allowance = warmup_allowance_s(args.precompile)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headrace bench utilization", description=__doc__,
                                     parents=[benchlib.bench_parser()])
    add_workload_args(parser)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per way")
    parser.add_argument("--out", default="",
                        help="keep each way's run folder under this folder (default: a temporary "
                             "one, removed)")
    parser.add_argument("--max-policy-lag", type=int, default=0,
                        help="the staleness limit of sync and async (default: the smallest that "
                             "admits the in-flight groups Little's law calls for)")
    parser.add_argument("--prefill-groups", type=int, default=8192)
    args = parser.parse_args(argv)
    settle_workload_args(args)
    if args.quick:
        args.env_latency, args.duration, args.groups_per_batch = 0.05, 5.0, 4
        args.prefill_groups, args.warmup_allowance = 64, 30.0
        args.d_model, args.n_layers = 64, 2
    if min(args.epochs, args.groups_per_batch) < 1 or args.env_latency < 0:
        parser.error("--epochs and --groups-per-batch must be >= 1, --env-latency >= 0")
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[1:])  # core 0 is the learner's
    with (contextlib.nullcontext(args.out) if args.out
          else tempfile.TemporaryDirectory(prefix="headrace-bench-")) as tmp:
        root = pathlib.Path(tmp)
        alone = learner_alone(args, root / "alone")
        consume_groups_per_s = alone["steps_per_s"] * args.groups_per_batch
        # Little's law: groups in flight = consume rate x group latency. A minute of training
        # leaves most episodes at their full 5 turns; a turn is a lognormal env step (mean
        # median x exp(sigma^2 / 2)) plus its wait for a batched policy call.
        step_mean_s = args.env_latency * math.exp(SIGMA**2 / 2)
        episode_s = MAX_TURNS * (step_mean_s + TURN_INFERENCE_S)
        needed = consume_groups_per_s * episode_s
        headroom = 1.25
        slots = max(1, math.ceil(needed * headroom))
        if args.quick:  # a smoke run: a pool that starts in seconds (its few steps, most of
            slots = QUICK_GROUPS  # them compiling, measure no steady rate to size one from)
        # The staleness limit and buffer that admit the pool (`audit.admitting_limits`): the
        # pool, not the limit, then bounds what is in flight.
        args.max_policy_lag, capacity = admitting_limits(8 * slots, 8, args.groups_per_batch,
                                                         args.max_policy_lag)
        sync_data = base_config(args, root / "sync")
        sync_data["run"]["mode"] = "sync"
        sync_data["actor"]["envs_per_actor"] = 8 * max(args.groups_per_batch, 1)
        sync = run_training(sync_data)
        async_data = base_config(args, root / "async")
        # max_batch stays 1,024: a call over thousands of episodes would hold each of them for
        # its whole length; a large turn is served by several calls instead.
        async_data["actor"]["envs_per_actor"] = 8 * slots
        async_data["buffer"]["capacity"] = capacity
        result_async = run_training(async_data)
    result = {
        "learner_alone": alone, "sync": sync, "async": result_async,
        "little": {"consume_groups_per_s": consume_groups_per_s, "episode_s": episode_s,
                   "in_flight_groups_needed": needed, "headroom": headroom,
                   "envs_per_actor_async": 8 * slots,
                   "max_policy_lag": args.max_policy_lag,
                   "admission_window_groups": capacity, "buffer_capacity_async": capacity},
        "settings": {"env_latency_s": args.env_latency, "duration_s": args.duration,
                     "groups_per_batch": args.groups_per_batch, "group_size": 8,
                     "d_model": args.d_model, "n_layers": args.n_layers,
                     "epochs": args.epochs, "keep_cache": args.keep_cache,
                     "precompile": args.precompile,
                     "learner_cpus": PLACEMENT["learner_cpus"]},
        "async_over_sync_steps": (result_async["steps_per_s"] / sync["steps_per_s"]
                                  if sync["steps_per_s"] else None),
        "async_over_alone_steps": (result_async["steps_per_s"] / alone["steps_per_s"]
                                   if alone["steps_per_s"] else None),
    }
    benchlib.emit(result, as_json=args.json, title="learner utilisation: alone / sync / async")
    return 0


if __name__ == "__main__":
    sys.exit(main())
