"""`headrace bench real`: a real LLM learns a real task on this machine.

    headrace bench real [--quick] [--json] [--budget-s 5400] [--out DIR] [--set KEY=VALUE ...]

Runs `examples/smollm2_reasoning.yaml` (SmolLM2-135M-Instruct from its package, a reasoning-gym
task, GRPO on the async multi-process runtime):

  base      greedy held-out success of the untrained model: successes, tasks (>= 256, the env's
            `eval_seeds()`), rate and its 95 % Clopper-Pearson interval
  trained   the same measure on the final weights, after `--budget-s` seconds of training
            (`run.max_wall_s`; the run's own final evaluation: `headrace.runtime.supervise`)
  gain      trained rate - base rate (target: >= 0.10)
  learner_tokens_per_s    trained tokens per second (`learner/tokens_per_s`, steady state)
  sampler_tokens_per_s    generated tokens per second over the run's training window (episodes'
                          sampled tokens, from the trajectories the buffer handed the learner)
  utilization, lag_mean, lag_max, steps, versions_published, versions_acted
  curve     [[learner step, reward mean], ...] and the PNG of it (`curve.png` in the run folder)

`--quick` (the suite's smoke test, ~1 minute) swaps the model for a 2-layer random Llama written
with transformers into a temporary folder and loaded through the same `hf:` path, a tiny
byte-level tokenizer with the ChatML template, the threads launcher, 32 held-out tasks and
`QUICK_STEPS` learner steps; its figures mean nothing, it shows the pipeline works end to end.
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

EXAMPLE = benchlib.EXAMPLES / "smollm2_reasoning.yaml"
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QUICK_EVAL = 32
QUICK_STEPS = 3  # --quick stops here (or at its budget)


def binomial_interval(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The Clopper-Pearson (exact) interval of a success rate."""
    from scipy.stats import binomtest

    ci = binomtest(successes, n).proportion_ci(confidence_level=level, method="exact")
    return float(ci.low), float(ci.high)


def held_out(rate: float, n: int) -> dict[str, Any]:
    successes = round(rate * n)
    low, high = binomial_interval(successes, n)
    return {"successes": successes, "tasks": n, "rate": successes / n, "ci95": [low, high]}


def tiny_llama(folder: pathlib.Path) -> pathlib.Path:
    """A 2-layer random Llama and a byte-level BPE tokenizer with ChatML, written offline."""
    import tokenizers
    import torch
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                  "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    from reasoning_gym.utils import SYSTEM_PROMPTS

    text = [SYSTEM_PROMPTS["direct"], "State the final answer to the following arithmetic problem:",
            "<answer>12</answer> 0 1 2 3 4 5 6 7 8 9 + - ="]
    backend.train_from_iterator(text * 8, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>", bos_token=None)
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    config = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, max_position_embeddings=512,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def overrides(args: argparse.Namespace, out: pathlib.Path) -> list[str]:
    sets = [f"run.dir={out / 'run'}", "run.stop_at_target=false", f"run.max_wall_s={args.budget_s}"]
    if args.quick:
        model = tiny_llama(out / "tiny-llama")
        sets += [f"model.init_from=hf:{model}", "run.launcher=threads",
                 f"run.max_steps={QUICK_STEPS}", "buffer.backend=memory",
                 "weights.backend=memory", f"env.kwargs.eval_size={QUICK_EVAL}",
                 "actor.envs_per_actor=16", "actor.max_batch=16", "learner.groups_per_batch=2",
                 "sampling.max_new_tokens=8", "learner.optimizer.lr=1e-3", "shapes.buckets=[256]",
                 # admission then lets v0 generate only steps 1-2's groups: step 3 trains data
                 # acted with weights >= v1 (the example's lag 2 admits all three at v0 while
                 # the learner compiles, and the actors may never act with a published version)
                 "staleness.max_policy_lag=1"]
    return sets + list(args.set)


def base_success(config) -> dict[str, Any]:
    """Greedy held-out success of the untrained model (blocking)."""
    from headrace.runtime import build
    from headrace.runtime.evaluation import untrained_success

    task = build.build_task(config)
    rate, seeds = untrained_success(config, 0, task)
    probe = task.make_env()
    held = all(probe.reset(seed)[1].get("held_out") for seed in seeds)  # what the env says
    probe.close()
    return {**held_out(rate, len(seeds)), "all_held_out": held}


def run_figures(summary: dict[str, Any], n: int) -> dict[str, Any]:
    """The trained figures from a run's summary and metrics.jsonl."""
    records = read_records(summary["run_dir"])
    last = records[-1] if records else {}
    curve = [[r.get("learner/step", 0), r["reward/mean"]] for r in records if "reward/mean" in r]
    return {
        "trained": held_out(summary["final_success_rate"], n),
        "steps": summary["steps"],
        "episodes": summary["episodes"],
        "wall_s": summary["wall_s"],
        "stopped_by": summary["stopped_by"],
        "errors": summary["errors"],
        "learner_tokens_per_s": last.get("learner/tokens_per_s", 0.0),
        "utilization": summary["learner_utilization"],
        "lag_mean": last.get("staleness/lag_mean"),
        "lag_max": last.get("staleness/lag_max"),
        "versions_published": last.get("learner/version"),
        "curve": curve,
        "run_dir": summary["run_dir"],
        "_records": records,
    }


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    curve = result["curve"]
    if curve:
        ax.plot([c[0] for c in curve], [c[1] for c in curve], label="reward mean (training)")
    last_step = max(result["steps"], 1)
    for x, key in ((0, "base"), (last_step, "trained")):
        m = result[key]
        ax.errorbar([x], [m["rate"]], yerr=[[m["rate"] - m["ci95"][0]], [m["ci95"][1] - m["rate"]]],
                    fmt="o", capsize=4, label=f"held-out success, {key} ({m['tasks']} tasks)")
    ax.set_xlabel("learner step")
    ax.set_ylabel("success / reward")
    ax.set_title("headrace bench real")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_bench(args: argparse.Namespace, out: pathlib.Path) -> dict[str, Any]:
    from headrace.config import load
    from headrace.runtime import train

    config = load(EXAMPLE, overrides(args, out))
    started = time.time()
    base = base_success(config)
    log.warning("bench real: base held-out success %s", base)
    t0 = time.time()
    summary = train(config, live=False, t0=t0)
    if summary["errors"]:  # reported as it is: no figures of a run that failed
        return {"quick": args.quick, "model": config.model.init_from, "base": base,
                **{k: summary[k] for k in ("steps", "wall_s", "stopped_by", "errors", "run_dir")}}
    figures = run_figures(summary, base["tasks"])
    records = figures.pop("_records")
    last = records[-1] if records else {}
    generated = last.get("actor/generated_tokens", 0.0)
    train_s = max(summary["wall_s"], 1e-9)  # start-up included: a lower bound of the rate
    result = {"quick": args.quick, "budget_s": args.budget_s, "model": config.model.init_from,
              "env": dict(config.env.kwargs), "base": base, **figures}
    result["gain"] = result["trained"]["rate"] - base["rate"]
    result["generated_tokens"] = generated
    result["sampler_tokens_per_s"] = generated / train_s
    result["truncated_episodes"] = last.get("actor/truncated", 0.0)  # the context ran out
    result["truncated_trajectories"] = last.get("batch/truncated", 0.0)  # cut to a bucket
    result["versions_acted"] = last.get("actor/weights_version")
    png = pathlib.Path(figures["run_dir"]) / "curve.png"
    plot(result, png)
    result["png"] = str(png)
    result["bench_s"] = round(time.time() - started, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headrace bench real",
                                     description=__doc__.split("\n\n")[0],
                                     parents=[benchlib.bench_parser()])
    parser.add_argument("--budget-s", type=float, default=None,
                        help="training seconds (run.max_wall_s); default 5400, 400 with --quick "
                             "(a safety cap there: the quick run stops at its steps)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override on top of the example's (repeatable), as "
                             "`headrace train --set`")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="keep the run folder, the PNG and result.json here")
    args = parser.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 400.0 if args.quick else 5400.0
    if args.budget_s <= 0:
        parser.error("--budget-s must be > 0")
    logging.getLogger().setLevel(logging.WARNING)
    with contextlib.ExitStack() as stack:
        if args.out is None:
            out = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-real-")))
        else:
            out = args.out
            out.mkdir(parents=True, exist_ok=True)
        result = run_bench(args, out)
        if args.out is not None:
            (out / "result.json").write_text(json.dumps(result, indent=2))
        if "png" in result:
            result["png_written"] = pathlib.Path(result["png"]).stat().st_size > 0
    return benchlib.finish(result, [f"the run failed: {e}" for e in result["errors"]],
                           as_json=args.json, title="headrace bench real")


log = logging.getLogger("headrace.bench.real")

if __name__ == "__main__":
    sys.exit(main())
