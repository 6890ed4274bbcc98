"""The warm-up job behind `headrace sft CONFIG` (see `headrace.sft`)."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import pathlib
import sys
import time
from typing import Any

import numpy as np
import yaml

from headrace.config import Config, ConfigError
from headrace.rundir import RunDir
from headrace.sft.demos import ActionCoder, SftError, read_jsonl, solver_demos, to_group
from headrace.sft.warm_start import SFT_KIND, sft_learner_config

log = logging.getLogger(__name__)


def _run_dir(config: Config) -> pathlib.Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = pathlib.Path(config.sft.dir.format(env=config.env.name.replace(":", "."), time=stamp))
    if (path / RunDir.CHECKPOINTS).exists() and any((path / RunDir.CHECKPOINTS).iterdir()):
        raise ConfigError(f"sft.dir={str(path)!r} already holds a warm-up; choose another folder")
    path.mkdir(parents=True, exist_ok=True)
    (path / RunDir.CONFIG).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    return path


def _check_lengths(groups: list, config: Config) -> None:
    """Demonstrations longer than the largest bucket are cut to it or left out, as
    `shapes.overlong` says (each counted: `batch/truncated`, `batch/rejected`); all of them left
    out is an error."""
    largest = config.shapes.buckets[-1]
    lengths = [len(g.trajectories[0]) for g in groups]
    over = sum(n > largest for n in lengths)
    if not over:
        return
    reject = config.shapes.overlong == "reject"
    if reject and over == len(groups):
        raise SftError(f"every demonstration is longer than the largest bucket ({largest} tokens; "
                       f"the longest has {max(lengths)}) and shapes.overlong is 'reject': nothing "
                       "would be trained. Raise shapes.buckets")
    log.warning("%d of %d demonstrations (up to %d tokens) exceed the largest bucket (%d): they "
                "are %s (counted in batch/%s); raise shapes.buckets", over, len(groups),
                max(lengths), largest, "left out" if reject else "cut to it",
                "rejected" if reject else "truncated")


def run(config: Config, *, echo: bool = True) -> dict[str, Any]:
    """Runs the warm-up (blocking); returns the summary (also RUN_DIR/summary.json).

    Args:
      echo: print a progress line per evaluation on stderr.

    Raises:
      ConfigError: a bad config or `model.init_from`. SftError: demonstrations cannot be made.
      EnvError: the environment cannot be built.
    """
    import jax
    import jax.numpy as jnp

    from headrace.actor.evaluate import eval_seeds, evaluate
    from headrace.learner.batching import Batcher
    from headrace.learner.checkpoint import Checkpointer
    from headrace.learner.train_step import init_state, make_optimizer, make_train_step
    from headrace.metrics.core import Metrics
    from headrace.metrics.sinks import JsonlSink, TensorBoardSink
    from headrace.runtime import build

    t0 = time.time()
    sft = config.sft
    task = build.build_task(config)
    settings = task.sampler_settings
    coder = ActionCoder(task.tokenizer, settings.allowed_ids, settings.max_new_tokens)
    failures = 0
    if sft.demos == "solver":
        demos, failures = solver_demos(config, task.make_env, coder)
    else:
        demos = read_jsonl(pathlib.Path(sft.demos), task.make_env, task.tokenizer, coder)
    groups = [to_group(d, i, config.env.name) for i, d in enumerate(demos)]
    _check_lengths(groups, config)
    run_dir = _run_dir(config)
    graphdef, params = build.init_params(config, task)
    learner = sft_learner_config(config)
    optimizer = make_optimizer(learner.optimizer)
    state = init_state(params, optimizer, 0.0)
    allowed_v = settings.allowed_mask(task.dims.vocab_size)
    train_step = make_train_step(graphdef, learner, config.sampling.temperature, optimizer,
                                 allowed_v)
    metrics = Metrics()
    batcher = Batcher(learner, config.shapes, metrics)
    sampler = build.make_sampler(config, task, graphdef, seed=config.run.seed + 7)
    probe = task.make_env()
    seeds = eval_seeds(probe, sft.eval_episodes)
    probe.close()
    sinks = [JsonlSink(run_dir / RunDir.METRICS), TensorBoardSink(run_dir / RunDir.TENSORBOARD)]
    curve: list[dict[str, float]] = []

    def greedy(step: int) -> float:
        sampler.set_params(jax.tree.map(jnp.copy, state.params), step)  # the step donates state
        result = evaluate(task.make_env, task.tokenizer, sampler, seeds,
                          config.env.step_timeout_s, config.actor.max_batch)
        curve.append({"step": step, "wall_s": round(time.time() - t0, 2),
                      "success_rate": result["success_rate"]})
        if echo:
            print(f"sft step {step}: greedy success {result['success_rate']:.3f}",
                  file=sys.stderr, flush=True)
        return result["success_rate"]

    rng = np.random.default_rng(config.run.seed)
    order: list[int] = []
    record: dict[str, float] = {}
    loss = float("nan")
    tokens_done, train_s = 0, 0.0
    try:
        initial = greedy(0)
        for step in range(1, sft.steps + 1):
            while len(order) < sft.batch_size:  # fewer demonstrations than a batch: repeat
                order += list(rng.permutation(len(groups)))
            picked, order = order[:sft.batch_size], order[sft.batch_size:]
            batch = batcher.build([groups[i] for i in picked])
            for mb in batch.microbatches:  # every demonstrated token is a target: advantage 1
                mb.arrays["advantages"][:] = 1.0
            start = time.perf_counter()
            state, step_metrics = train_step(state, batch)
            step_metrics = jax.device_get(step_metrics)  # deliberate sync: timing, logging
            train_s += time.perf_counter() - start
            tokens_done += batch.loss_tokens
            loss = float(step_metrics.get("loss/pg", float("nan")))
            record = {"sft/loss": loss, "sft/step": step,
                      "sft/tokens_per_s": tokens_done / max(train_s, 1e-9),
                      "sft/steps_per_s": step / max(train_s, 1e-9),
                      "learner/grad_norm": float(step_metrics.get("learner/grad_norm", 0.0)),
                      "learner/param_norm": float(step_metrics.get("learner/param_norm", 0.0)),
                      **metrics.snapshot()}  # the batcher's: packing, truncated, rejected
            if sft.eval_every and step % sft.eval_every == 0 and step < sft.steps:
                record["eval/success_rate"] = greedy(step)
            if step % config.run.log_every == 0 or "eval/success_rate" in record:
                for sink in sinks:
                    sink.write(step, record)
        final = greedy(sft.steps)
        record["eval/success_rate"] = final
        for sink in sinks:
            sink.write(sft.steps, record)
        dims = dataclasses.asdict(task.dims)
        metadata = {"kind": SFT_KIND, "learner_step": sft.steps, "dims": dims,
                    "text": dataclasses.asdict(config.text), "env": config.env.name,
                    "demos": len(demos), "time": time.time()}
        with Checkpointer(run_dir / RunDir.CHECKPOINTS, keep=1) as checkpointer:
            checkpointer.save(sft.steps, state, metadata)
    finally:
        for sink in sinks:
            sink.close()
    lengths = [d.renderer.builder.length for d in demos]
    known = [d.success for d in demos if d.success is not None]
    summary = {
        "kind": SFT_KIND,
        "steps": sft.steps,
        "demos": len(demos),
        "demo_failures": failures,
        "demo_success_rate": float(np.mean(known)) if known else None,
        "demo_tokens_mean": float(np.mean(lengths)),
        # demonstration passes over the largest bucket: cut to it, or left out (shapes.overlong)
        "batch_truncated": int(metrics.counters.get("batch/truncated", 0)),
        "batch_rejected": int(metrics.counters.get("batch/rejected", 0)),
        "initial_success_rate": initial,
        "final_success_rate": final,
        "final_loss": loss,
        "tokens_per_s": record.get("sft/tokens_per_s", 0.0),
        "wall_s": round(time.time() - t0, 2),
        "run_dir": str(run_dir),
        "eval_curve": curve,
    }
    build.write_json(run_dir / RunDir.SUMMARY, summary)
    return summary
