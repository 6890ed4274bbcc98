"""`headrace bench envs`: every built-in environment's example config, run for a fixed budget.

    headrace bench envs [--quick] [--json] [--envs gym_frozenlake,tool_calculator,...]
                        [--budget-s 180] [--out DIR]

Each example (`examples/<name>.yaml`) runs through `headrace train`'s code path
(`headrace.runtime.train`, with the example's launcher: the multi-process runtime) for at most
`--budget-s` seconds of training, and for the learner steps given below (steps make runs
comparable; the budget caps them). Per environment, from the run's metrics.jsonl and summary.json:

  learner_steps_per_s   learner steps per second of training (`learner/steps_per_s`, last record;
                        steady state: steps that compiled are left out)
  steps, wall_s         learner steps done, wall time of the run (start-up included)
  actor_env_s_p50/p99   environment step latency (`actor/env_s`, last record: its window)
  reward_mean_first/last  `reward/mean` in the first and the last record (the trend)
  eval_curve            greedy evaluations: [[learner step, success rate], ...]
  final_success_rate    greedy success of the final weights (64 tasks, or the env's own list)

What runs:

- `gym_frozenlake` (4x4, not slippery): RL from scratch, `FROZENLAKE_STEPS` steps;
  `random_success_rate` is a uniform random policy's, measured here on 20,000 episodes.
- `tool_calculator`: a warm-up (`headrace sft`, the example's `sft` section) then RL from it
  (`model.init_from`), `CALC_STEPS` steps; then the same again with the tool disabled
  (`env.kwargs.tool_enabled=false`: the solver demonstrates the bare answer). `no_tool` holds the
  baseline's figures, `sft` both warm-ups', `tool_gain` the difference of final successes.
- `http_tool`: starts a `CalculatorService` on loopback (3 % injected 503s, so retries show in
  the latency tail) and trains from the tool warm-up above (same questions, template and model),
  so the policy really calls the service; `http` holds the service's request counts.
- `python_exec`: a warm-up on the reference solutions (the example's `sft` section), then RL
  from it, every program graded in the sandbox (`sft` holds the warm-up's figures); skipped, with
  the reason, where the sandbox refuses to start. `gym_cartpole`: RL from scratch.

`--quick` is a smoke test of the same code path for the tests (about a minute): the threads
launcher, one learner step per environment, a 20-step warm-up, no periodic evaluation; its
figures mean nothing. Run folders go to a temporary directory, or `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import pathlib
import sys
import tempfile
import time
from typing import Any

from headrace import benchlib
from headrace.metrics.records import read_records

EXAMPLES = benchlib.EXAMPLES
ENVS = ("gym_frozenlake", "tool_calculator", "http_tool", "python_exec", "gym_cartpole")
FROZENLAKE_STEPS = 60
FROZENLAKE_EVAL = 2  # it learns in a few steps: evaluate often enough to see the curve
CALC_STEPS = 30
OTHER_STEPS = 0  # budget-bound
HTTP_FAIL_RATE = 0.03


def figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The per-environment figures (see the module docstring) of one training run."""
    records = read_records(summary["run_dir"], missing_ok=True)
    rewards = [r["reward/mean"] for r in records if "reward/mean" in r]
    last = records[-1] if records else {}
    return {
        "learner_steps_per_s": last.get("learner/steps_per_s", 0.0),
        "steps": summary["steps"],
        "wall_s": summary["wall_s"],
        "actor_env_s_p50": last.get("actor/env_s_p50"),
        "actor_env_s_p99": last.get("actor/env_s_p99"),
        "reward_mean_first": rewards[0] if rewards else None,
        "reward_mean_last": rewards[-1] if rewards else None,
        "eval_curve": [[p["step"], p["success_rate"]] for p in summary.get("eval_curve", [])],
        "final_success_rate": summary["final_success_rate"],
        "episodes": summary["episodes"],
        "stopped_by": summary["stopped_by"],
        "errors": summary["errors"],
    }


class Runner:
    """Builds each run's config from its example and runs it (blocking)."""

    def __init__(self, args: argparse.Namespace, out: pathlib.Path):
        self.args = args
        self.out = out

    def overrides(self, name: str, steps: int) -> list[str]:
        a = self.args
        sets = [f"run.dir={self.out / name}", "run.stop_at_target=false"]
        if not a.quick:
            return sets + [f"run.max_wall_s={a.budget_s}", f"run.max_steps={steps}"]
        return sets + ["run.launcher=threads", "run.max_steps=1", "run.eval_every=0",
                       "run.max_wall_s=300", "buffer.backend=memory", "weights.backend=memory",
                       "actor.envs_per_actor=8", "actor.max_batch=8",
                       "learner.groups_per_batch=1", "learner.minibatches=1"]

    def train(self, name: str, example: str, steps: int, extra: list[str] = ()) -> dict:
        from headrace.config import load
        from headrace.runtime import train

        config = load(EXAMPLES / f"{example}.yaml", [*self.overrides(name, steps), *extra])
        log.warning("bench envs: training %s", name)
        return figures(train(config, live=False, t0=time.time()))  # wall clock of this run

    def sft(self, name: str, example: str, extra: list[str] = ()) -> dict:
        from headrace.config import load
        from headrace.runtime import sft

        sets = [f"sft.dir={self.out / name}"]
        if self.args.quick:
            sets += ["sft.steps=20", "sft.episodes=64", "sft.eval_every=0",
                     "sft.eval_episodes=8", "actor.max_batch=8"]
        sets += extra
        log.warning("bench envs: warm-up %s", name)
        summary = sft.run(load(EXAMPLES / f"{example}.yaml", sets), echo=False)
        keep = ("demos", "steps", "final_loss", "initial_success_rate", "final_success_rate",
                "tokens_per_s", "wall_s", "run_dir")
        return {**{k: summary[k] for k in keep},
                "eval_curve": [[p["step"], p["success_rate"]] for p in summary["eval_curve"]]}


def initial_success(example: str) -> float:
    """Greedy success of the untrained model (the example's seed) on the evaluation tasks."""
    from headrace.config import load
    from headrace.runtime.evaluation import untrained_success

    return untrained_success(load(EXAMPLES / f"{example}.yaml"), 64)[0]


def random_frozenlake(episodes: int = 20000, max_turns: int = 12) -> float:
    """Success rate of a uniform random policy on FrozenLake 4x4, not slippery."""
    import random

    from headrace.env.gym_adapter import GymEnv

    env = GymEnv(id="FrozenLake-v1", is_slippery=False, map_name="4x4", max_turns=max_turns)
    rng = random.Random(0)
    wins = 0
    try:
        for seed in range(episodes):
            env.reset(seed)
            while True:
                _, _, terminated, truncated, info = env.step(rng.choice(env.spec.action_words))
                if terminated or truncated:
                    wins += bool(info.get("success"))
                    break
    finally:
        env.close()
    return wins / episodes


def bench_calculator(runner: Runner) -> tuple[dict, str]:
    """Tool vs no tool: the same warm-up and number of RL steps; returns (figures, warm-up dir)."""
    tool_sft = runner.sft("sft-tool_calculator", "tool_calculator")
    result = runner.train("tool_calculator", "tool_calculator", CALC_STEPS,
                          [f"model.init_from={tool_sft['run_dir']}"])
    off = ["env.kwargs.tool_enabled=false"]
    plain_sft = runner.sft("sft-tool_calculator-no_tool", "tool_calculator", off)
    baseline = runner.train("tool_calculator-no_tool", "tool_calculator", CALC_STEPS,
                            [*off, f"model.init_from={plain_sft['run_dir']}"])
    result["no_tool"] = baseline
    result["no_tool_final_success_rate"] = baseline["final_success_rate"]
    both = (result["final_success_rate"], baseline["final_success_rate"])
    result["tool_gain"] = None if None in both else both[0] - both[1]  # None: a run failed
    result["sft"] = {"tool": tool_sft, "no_tool": plain_sft}
    return result, tool_sft["run_dir"]


def bench_http(runner: Runner, warm: str | None) -> dict:
    from headrace.env.http_tool import CalculatorService

    service = CalculatorService(fail_rate=HTTP_FAIL_RATE, seed=0).start()
    try:
        extra = [f"env.kwargs.url={service.url}"]
        if warm:
            extra.append(f"model.init_from={warm}")
        result = runner.train("http_tool", "http_tool", OTHER_STEPS, extra)
    finally:
        service.stop()
    result["http"] = dict(service.stats)
    return result


def bench_python(runner: Runner) -> dict:
    """A warm-up on the reference solutions (graded in the sandbox when replayed), then RL."""
    quick = ["sft.episodes=8"] if runner.args.quick else []
    warm = runner.sft("sft-python_exec", "python_exec", quick)
    result = runner.train("python_exec", "python_exec", OTHER_STEPS,
                          [f"model.init_from={warm['run_dir']}"])
    result["sft"] = warm
    return result


def sandbox_refusal() -> str | None:
    """Why python_exec cannot run here, or None when the sandbox starts."""
    from headrace.env.sandbox import SandboxUnavailable, probe

    try:
        probe()
    except SandboxUnavailable as error:
        return str(error)
    return None


def run_bench(args: argparse.Namespace, out: pathlib.Path) -> dict[str, Any]:
    runner = Runner(args, out)
    result: dict[str, Any] = {"quick": args.quick, "budget_s": args.budget_s, "envs": {}}
    envs = result["envs"]
    warm: str | None = None
    for name in args.envs:
        started = time.time()
        if name == "gym_frozenlake":
            envs[name] = runner.train(name, name, FROZENLAKE_STEPS,
                                      [] if args.quick else [f"run.eval_every={FROZENLAKE_EVAL}"])
            envs[name]["initial_success_rate"] = initial_success(name)
            envs[name]["random_success_rate"] = random_frozenlake()
        elif name == "tool_calculator":
            envs[name], warm = bench_calculator(runner)
        elif name == "http_tool":
            envs[name] = bench_http(runner, warm)
        elif name == "python_exec":
            reason = sandbox_refusal()
            envs[name] = {"skipped": reason} if reason else bench_python(runner)
        else:  # gym_cartpole
            short = ["env.kwargs.max_turns=10"] if args.quick else []
            envs[name] = runner.train(name, name, OTHER_STEPS, short)
        envs[name]["bench_s"] = round(time.time() - started, 1)
    return result


def _envs(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in ENVS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"--envs={text!r}: unknown {', '.join(unknown) or '-'}; "
                                         f"choose from {', '.join(ENVS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headrace bench envs",
                                     description=__doc__.split("\n\n")[0],
                                     parents=[benchlib.bench_parser()])
    parser.add_argument("--envs", type=_envs, default=list(ENVS),
                        help="which examples, comma-separated (http_tool warm-starts from "
                             "tool_calculator's warm-up when both run)")
    parser.add_argument("--budget-s", type=float, default=180.0,
                        help="training seconds per run at most (run.max_wall_s)")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="keep run folders (and result.json) here instead of a temp dir")
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error("--budget-s must be > 0")
    logging.getLogger().setLevel(logging.WARNING)
    with contextlib.ExitStack() as stack:
        if args.out is None:
            temp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-envs-"))
            out = pathlib.Path(temp)
        else:
            out = args.out
            out.mkdir(parents=True, exist_ok=True)
        result = run_bench(args, out)
        if args.out is not None:
            (out / "result.json").write_text(json.dumps(result, indent=2))
    return benchlib.finish(result, failed_runs(result), as_json=args.json,
                           title="headrace bench envs")


def failed_runs(result: dict) -> list[str]:
    """A line for each run that ended with errors (the bench then exits 1)."""
    runs = [(name, figures) for name, figures in result["envs"].items()]
    runs += [(f"{name} (no tool)", figures["no_tool"]) for name, figures in result["envs"].items()
             if "no_tool" in figures]
    return [f"{name}: the run failed: {'; '.join(figures['errors'])}"
            for name, figures in runs if figures.get("errors")]


log = logging.getLogger("headrace.bench.envs")

if __name__ == "__main__":
    sys.exit(main())
