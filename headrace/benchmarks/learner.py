"""`headrace bench learner`: a model's learner step and sampler, float32 against bfloat16 and
remat off against on, side by side.

    headrace bench learner [CONFIG] [--dtypes float32,bfloat16] [--remats none,block]
                           [--prompt-len 73] [--answer-len 24] [--steps 3] [--set KEY=VALUE ...]
                           [--model-config CONFIG.json] [--peak-tflops T] [--quick] [--json]

CONFIG (default: `examples/smollm2_reasoning.yaml`) says the model (`model.init_from`), the
learner (loss, groups per step, group size, minibatches, buckets) and the sampler (`actor.max_batch`,
`sampling.max_new_tokens`). For each `model.dtype` x `model.remat` the learner step is built as a
run builds it (`learner_step`, `init_state` with `learner.master_dtype`, the real `Batcher`) and
fed synthetic groups of the config's shape: `--prompt-len` prompt tokens and `--answer-len` answer
tokens per episode (the example's episodes: ~73 + up to 24). `--model-config` takes a Hugging
Face `config.json` instead of `model.init_from`: random weights of that architecture (nothing is
read but the file; `examples/qwen2.5_0.5b_config.json` is Qwen2.5-0.5B's), the config's learner,
shapes and sampler kept. Reported per variant:

  step_s            median seconds of a learner step after the first (each step waited for)
  tokens_per_s      the batch's real tokens / step_s (what `learner/tokens_per_s` counts)
  first_step_s      the first step, its compile included
  temp_mib          the compiled microbatch program's scratch (`memory_analysis()`): what remat
                    and bf16 change, independent of the machine's speed
  gflop_per_step    XLA's count of the step's floating-point operations (`cost_analysis()`, per
                    microbatch times microbatches): remat's recomputation shows here
  gflop_per_s       gflop_per_step / step_s: the arithmetic rate the machine reached
  bf16_ops          bfloat16 values in the compiled program's text (0 when it computes in float32)
  model_gflop_per_token  the model FLOPs of a trained token: 6 x the matmul parameters (the
                    LM head included, the embedding lookup not) + 12 x layers x heads x head size
                    x the episode's length (PaLM's count: causal attention not halved; packed
                    episodes attend within themselves)
  mfu, hfu          with `--peak-tflops`: model FLOPs per second (tokens_per_s x
                    model_gflop_per_token) and XLA's counted FLOPs per second (gflop_per_s, remat's
                    recomputation and masked attention included) over that peak
  sampler_tokens_per_s  (per dtype) the actors' sampler, `actor.max_batch` rows of the prompt
                    length generating `sampling.max_new_tokens` each (no stop token), median of
                    `--steps` calls after a compile

`--quick` (the tests) swaps in `bench real`'s 2-layer random Llama (written with transformers,
loaded through the same `hf:` path) and times two steps.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

from headrace import benchlib
from headrace.benchmarks import real

EXAMPLE = benchlib.EXAMPLES / "smollm2_reasoning.yaml"


def model_gflop_per_token(dims, params, episode_len: int) -> float:
    """Training FLOPs of one token (6N + 12 L H e T; see the module docstring), in GFLOP."""
    from headrace.model import params as params_lib

    matmul = params_lib.count(params) - (0 if dims.tie_embeddings else dims.vocab_size * dims.d_model)
    head_size = dims.head_size or dims.d_model // dims.n_heads
    return (6 * matmul + 12 * dims.n_layers * dims.n_heads * head_size * episode_len) / 1e9


def learner_row(config, task, params, steps: int, prompt_answer: tuple[int, int]) -> dict:
    """One variant's learner figures (the config's dtype and remat)."""
    import jax

    from headrace.learner.batching import Batcher
    from headrace.learner.sharded_step import learner_step
    from headrace.learner.train_step import init_state, make_optimizer
    from headrace.metrics.core import Metrics
    from headrace.model import params as params_lib

    lc = config.learner
    optimizer = make_optimizer(lc.optimizer)
    graphdef = params_lib.graphdef(task.dims)
    step, row_multiple = learner_step(config, graphdef, optimizer,
                                      task.sampler_settings.allowed_mask(task.dims.vocab_size))
    state = init_state(jax.tree.map(lambda x: x.copy(), params), optimizer, lc.kl_coef,
                       lc.master_dtype)
    batcher = Batcher(lc, config.shapes, Metrics(), row_multiple=row_multiple)
    size = config.actor.group_size
    batches = [batcher.build(benchlib.token_groups(lc.groups_per_batch, task.dims.vocab_size, seed,
                                                   size=size, prompt_answer=prompt_answer))
               for seed in range(1 + steps)]
    compiled = step.compiled(state, batches[0].microbatches[0].arrays)
    analysis, cost = compiled.memory_analysis(), compiled.cost_analysis()
    times = []
    for batch in batches:
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))  # timing: the whole step
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times[1:])
    return {"step_s": step_s, "first_step_s": times[0],
            "tokens_per_s": batches[0].real_tokens / step_s,
            "tokens_per_step": batches[0].real_tokens,
            "microbatches": len(batches[0].microbatches),
            "temp_mib": analysis.temp_size_in_bytes / 2**20,
            "gflop_per_step": cost["flops"] * len(batches[0].microbatches) / 1e9,
            "gflop_per_s": cost["flops"] * len(batches[0].microbatches) / 1e9 / step_s,
            "bf16_ops": compiled.as_text().count("bf16["),
            "model_gflop_per_token": model_gflop_per_token(task.dims, params, sum(prompt_answer))}


def sampler_row(config, task, params, repeats: int, prompt_len: int) -> dict:
    """The actors' sampler in the config's dtype: `actor.max_batch` rows, no stop token."""
    from headrace.learner.train_step import compute_params
    from headrace.model import params as params_lib
    from headrace.model.sampler import Sampler, SamplerSettings

    new = config.sampling.max_new_tokens
    rows = config.actor.max_batch
    sampler = Sampler(params_lib.graphdef(task.dims), SamplerSettings(max_new_tokens=new),
                      task.dims.vocab_size, [prompt_len + new], rows, seed=0)
    try:
        sampler.set_params(compute_params(params, task.dims), 0)
        prompts = np.random.default_rng(0).integers(0, task.dims.vocab_size,
                                                    (rows, prompt_len)).tolist()
        start = time.perf_counter()
        sampler.generate(prompts)  # compiles this shape
        first = time.perf_counter() - start
        seconds = benchlib.median_seconds(lambda: sampler.generate(prompts), repeats)
    finally:
        sampler.close()
    return {"sampler_tokens_per_s": rows * new / seconds, "sampler_call_s": seconds,
            "sampler_first_call_s": first, "sampler_rows": rows}


def _random_task(model_config: str, dtype: str):
    """A task-like holder of a config.json's dims (dtype `dtype`) and default sampler settings."""
    from types import SimpleNamespace

    from headrace.model.sampler import SamplerSettings
    from headrace.parallel.plan import read_dims

    return SimpleNamespace(dims=read_dims(model_config, dtype), sampler_settings=SamplerSettings())


def _mfu(row: dict, peak_tflops: float) -> dict:
    model = row["tokens_per_s"] * row["model_gflop_per_token"] / 1e3
    return {"model_tflop_per_s": model, "mfu": model / peak_tflops,
            "hfu": row["gflop_per_s"] / 1e3 / peak_tflops}


def run(args, sets: list[str]) -> dict:
    from headrace.config import load
    from headrace.model import params as params_lib
    from headrace.runtime import build

    prompt_answer = (args.prompt_len, args.answer_len)
    rows, params_by_dtype = {}, {}
    for dtype in args.dtypes:
        for remat in args.remats:
            config = load(args.config, sets + [f"model.dtype={dtype}", f"model.remat={remat}"])
            if args.model_config:  # random weights of that architecture
                task = _random_task(args.model_config, dtype)
                if dtype not in params_by_dtype:
                    params_by_dtype[dtype] = params_lib.init(task.dims, config.run.seed)[1]
            else:
                task = build.build_task(config)
                if dtype not in params_by_dtype:  # the checkpoint is read once per dtype
                    params_by_dtype[dtype] = build.init_params(config, task)[1]
            if remat == args.remats[0]:
                sampler = sampler_row(config, task, params_by_dtype[dtype], args.steps,
                                      args.prompt_len)
            else:
                sampler = {}
            row = {**learner_row(config, task, params_by_dtype[dtype], args.steps, prompt_answer),
                   **sampler}
            if args.peak_tflops:
                row.update(_mfu(row, args.peak_tflops))
            rows[f"{dtype}/{remat}"] = row
            print(f"bench learner: {dtype} remat {remat}: step {row['step_s']:.2f} s, "
                  f"{row['tokens_per_s']:.0f} tokens/s {json.dumps(row)}", file=sys.stderr,
                  flush=True)
    return {"config": str(args.config),
            "model": args.model_config or config.model.init_from,
            "params": params_lib.count(params_by_dtype[args.dtypes[0]]),
            "prompt_len": args.prompt_len, "answer_len": args.answer_len,
            "groups_per_step": config.learner.groups_per_batch,
            "group_size": config.actor.group_size, "variants": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headrace bench learner", parents=[benchlib.bench_parser()],
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default=str(EXAMPLE))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--remats", default="none,block")
    parser.add_argument("--prompt-len", type=int, default=73)
    parser.add_argument("--answer-len", type=int, default=24)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (and sampler calls)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--model-config", default="", metavar="CONFIG.json",
                        help="random weights of this Hugging Face architecture")
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="the accelerator's peak (e.g. 989 for an H100/H200 in bf16): adds mfu")
    args = parser.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.remats = [r for r in args.remats.split(",") if r]
    if args.quick:
        args.steps = min(args.steps, 2)
    if args.steps < 1 or args.prompt_len < 1 or args.answer_len < 1:
        parser.error("--steps, --prompt-len and --answer-len must be >= 1")
    if args.peak_tflops < 0:
        parser.error("--peak-tflops must be >= 0 (0: no mfu)")
    with tempfile.TemporaryDirectory(prefix="bench-learner-") as folder:
        sets = list(args.set)
        if args.quick and not args.model_config:
            sets.append(f"model.init_from=hf:{real.tiny_llama(pathlib.Path(folder))}")
        result = run(args, sets)
    return benchlib.finish(result, [], as_json=args.json, title="headrace bench learner")


if __name__ == "__main__":
    sys.exit(main())
