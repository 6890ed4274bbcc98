"""Packing benchmark: the same model trained on the same trajectories three ways.

    headrace bench packing [--dist lognormal|uniform|pareto|trace:FILE] [--trajectories 4096]
                           [--median 500] [--sigma 1.0] [--alpha 1.2] [--min-len 16]
                           [--max-len 4096] [--ladder default|auto] [--tail-splits 0]
                           [--max-shapes 8] [--preset micro] [--token-budget 4096] [--group-size 8]
                           [--groups-per-batch 16] [--ways bucketed,pad_to_max,per_length]
                           [--seed 0] [--quick] [--json]

Ways (each drives the real `Batcher` and the real jitted train step, the learner's code path):

- `bucketed`: the shape policy's buckets with best-fit-decreasing packing; one compiled program per
  (rows, bucket) shape at most. `--ladder default` is the powers of two 32..4096; `--ladder auto`
  is `headrace.shapes.choose_ladder` on the benchmarked lengths, with as many buckets as keep the
  policy's shapes (tail shapes included) within `--max-shapes`. `--tail-splits k` lets a partly
  filled microbatch use 1/2 .. 1/2^k of its bucket's rows (`shapes.tail_splits`).
- `pad_to_max`: every row the largest bucket, one trajectory per row: one shape, most padding.
- `per_length`: every minibatch padded to its own longest trajectory (no buckets), one per row:
  little padding on short minibatches, but shapes follow the data and recompile.

All three use the same model preset, token budget, optimizer, initial weights and step order, and
train on identical tokens (checked; nothing dropped; lengths above the largest bucket are truncated
alike by all three). Lengths: `lognormal` (median, sigma), `uniform` (min..max), `pareto` (heavy
tailed: min-len + a Lomax of shape `--alpha` scaled so the median is `--median`, default 131),
each clipped to [min-len, max-len]; or `trace:FILE` (`--lengths FILE`), one length per line in
file order, e.g. `benchmarks/data/smollm2_lengths.txt` (SmolLM2 episodes, see
`benchmarks/data/smollm2_lengths.py`). Trajectories are synthetic: random tokens, a loss mask on
the 75 % after a prompt, random rewards (so advantages are non-zero). The persistent compilation
cache is off and each way builds its own jitted step, so every compilation is real.

Output per way: packing_efficiency (real tokens / token slots), compiles (train-step programs
compiled), compile_s (JAX's trace + lower + compile time for them), tokens_per_s (steady state:
tokens / (wall - compile_s)), tokens_per_s_with_compile (tokens / wall) and wall_s (from the first
batch to the last step's end, host batching included). Each microbatch is waited for before the
next is dispatched, so a compilation never overlaps computation and compile_s is its own cost.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import threading
import time

import jax
import numpy as np

from headrace import config as config_lib
from headrace.benchlib import bench_parser, emit
from headrace.learner import packing
from headrace.learner.batching import Batcher
from headrace.learner.train_step import init_state, make_optimizer, make_train_step
from headrace.metrics import compiles
from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.model.transformer import ModelDims
from headrace.shapes import ShapePolicy, choose_ladder
from headrace.types import Group, Trajectory, Turn

WAYS = tuple(packing.LAYOUTS)
VOCAB = 256
# Attention over 4096-slot rows dominates on CPU; a one-layer model keeps pad_to_max affordable.
PRESETS = {"micro": dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64),
           **config_lib.MODEL_PRESETS}
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


class CompileClock:
    """Seconds JAX spent tracing, lowering and compiling functions named like `name`."""

    def __init__(self, name: str = "train_step"):
        self.name = name
        self.seconds = 0.0
        self._lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if event in _COMPILE_EVENTS and self.name in str(kwargs.get("fun_name", "")):
            with self._lock:
                self.seconds += duration


def read_lengths(path: str) -> np.ndarray:
    """One positive integer per line (blank lines and `#` comments skipped).

    Raises:
      ValueError: a line is not a positive integer (the message names the file and line).
    """
    lengths = []
    for number, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{path}:{number}: {line.strip()!r} is not a positive integer length")
        lengths.append(value)
    if not lengths:
        raise ValueError(f"{path}: no lengths (one positive integer per line)")
    return np.array(lengths, np.int64)


def sample_lengths(args, rng: np.random.Generator) -> np.ndarray:
    if args.dist == "lognormal":
        raw = rng.lognormal(np.log(args.median), args.sigma, args.trajectories)
    elif args.dist == "pareto":  # Lomax: median = scale * (2^(1/alpha) - 1) above min-len
        scale = max(args.median - args.min_len, 1.0) / (2 ** (1 / args.alpha) - 1)
        raw = args.min_len + scale * rng.pareto(args.alpha, args.trajectories)
    else:
        raw = rng.uniform(args.min_len, args.max_len + 1, args.trajectories)
    return np.clip(np.round(raw), args.min_len, args.max_len).astype(np.int64)


def auto_ladder(lengths: np.ndarray, largest: int, budget: int, tail_splits: int,
                max_shapes: int, smallest: int = 32) -> tuple[int, ...]:
    """`choose_ladder` with the most buckets whose policy has at most `max_shapes` shapes."""
    for count in range(max_shapes, 0, -1):
        ladder = choose_ladder(lengths, count, smallest=smallest, largest=largest)
        if len(ShapePolicy(ladder, budget, tail_splits=tail_splits).shapes()) <= max_shapes:
            return ladder
    return choose_ladder(lengths, 1, smallest=smallest, largest=largest)


def make_groups(lengths: np.ndarray, group_size: int, seed: int) -> list[Group]:
    """Synthetic groups: random tokens, a loss mask after a 25 % prompt, random rewards."""
    rng = np.random.default_rng(seed)
    groups = []
    for g, start in enumerate(range(0, len(lengths), group_size)):
        items = []
        for j, n in enumerate(lengths[start:start + group_size]):
            n = int(n)
            prompt = max(1, n // 4)
            mask = np.arange(n) >= prompt
            logp = np.where(mask, -np.log(VOCAB) + rng.normal(0, 0.3, n), 0).astype(np.float32)
            items.append(Trajectory(
                trajectory_id=f"p{g}-{j}", group_id=f"p{g}", task_id=f"task{g}", env="bench",
                actor_id="bench", tokens=rng.integers(0, VOCAB, n).astype(np.int32),
                loss_mask=mask, behaviour_logprobs=logp,
                policy_version=np.where(mask, 0, -1).astype(np.int32),
                turns=[Turn(0, prompt, "user"), Turn(prompt, n, "assistant", 0.0)],
                reward=float(rng.normal()), timings={"started": 0.0}))
        groups.append(Group(f"p{g}", f"task{g}", items, put_version=0))
    return groups


def run_way(way: str, groups: list[Group], cfg: config_lib.Config, dims: ModelDims,
            clock: CompileClock) -> tuple[dict, int]:
    """Trains a fresh model on `groups` with layout `way`; returns (result, tokens trained)."""
    lc = cfg.learner
    batcher = Batcher(lc, cfg.shapes, Metrics(), layout=way)
    graphdef, params = params_lib.init(dims, cfg.run.seed)
    optimizer = make_optimizer(lc.optimizer)
    state = init_state(params, optimizer, lc.kl_coef)
    step = make_train_step(graphdef, lc, cfg.sampling.temperature, optimizer)
    jax.block_until_ready(state)
    compiles_before, clock_before = compiles.compiles("train_step"), clock.seconds
    tokens = slots = 0
    start = time.perf_counter()
    for first in range(0, len(groups), lc.groups_per_batch):
        batch = batcher.build(groups[first:first + lc.groups_per_batch])
        state, metrics = step(state, batch, sync=True)  # compiles never overlap computation
        jax.device_get(metrics)
        tokens += batch.real_tokens
        slots += batch.slots
    wall = time.perf_counter() - start
    compile_s = clock.seconds - clock_before
    steady = max(wall - compile_s, 1e-9)
    return {"packing_efficiency": tokens / max(slots, 1),
            "compiles": compiles.compiles("train_step") - compiles_before,
            "compile_s": compile_s, "tokens_per_s": tokens / steady,
            "tokens_per_s_with_compile": tokens / wall, "wall_s": wall}, tokens


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headrace bench packing", parents=[bench_parser()],
                                     description="bucketed packing vs pad-to-max vs per-length")
    parser.add_argument("--dist", default="lognormal",
                        help="lognormal, uniform, pareto or trace:FILE (ignored with --lengths)")
    parser.add_argument("--lengths", help="file of trajectory lengths, one per line")
    parser.add_argument("--trajectories", type=int, default=4096,
                        help="trajectories sampled (a trace: its first this many)")
    parser.add_argument("--median", type=float, default=None,
                        help="median length (lognormal: default 500; pareto: default 131)")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma")
    parser.add_argument("--alpha", type=float, default=1.2, help="pareto tail index (> 0)")
    parser.add_argument("--ladder", choices=("default", "auto"), default="default",
                        help="buckets: powers of two 32..4096, or chosen from the lengths")
    parser.add_argument("--tail-splits", type=int, default=0, help="shapes.tail_splits")
    parser.add_argument("--max-shapes", type=int, default=8,
                        help="--ladder auto: the most shapes the policy may have")
    parser.add_argument("--min-len", type=int, default=16, help="lengths are clipped to >= this")
    parser.add_argument("--max-len", type=int, default=4096, help="lengths are clipped to <= this")
    parser.add_argument("--preset", choices=tuple(PRESETS), default="micro",
                        help="model preset (vocabulary 256); micro is this bench's own")
    parser.add_argument("--token-budget", type=int, default=4096, help="token slots per microbatch")
    parser.add_argument("--group-size", type=int, default=8, help="trajectories per group")
    parser.add_argument("--groups-per-batch", type=int, default=16, help="groups per step")
    parser.add_argument("--ways", default=",".join(WAYS), help="comma-separated subset of ways")
    parser.add_argument("--seed", type=int, default=0, help="lengths, tokens and weights seed")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    if not ways or set(ways) - set(WAYS):
        parser.error(f"--ways: a comma-separated subset of {', '.join(WAYS)}")
    if args.dist.startswith("trace:") and not args.lengths:
        args.lengths = args.dist.partition(":")[2]
    elif args.dist not in ("lognormal", "uniform", "pareto") and not args.lengths:
        parser.error(f"--dist {args.dist!r}: lognormal, uniform, pareto or trace:FILE")
    if args.median is None:
        args.median = 131.0 if args.dist == "pareto" else 500.0
    if min(args.trajectories, args.min_len, args.token_budget, args.group_size,
           args.groups_per_batch, args.max_shapes) < 1 or args.max_len < args.min_len \
            or args.median <= 0 or args.sigma < 0 or args.alpha <= 0 \
            or not 0 <= args.tail_splits <= 8:
        parser.error("counts, lengths, the budget and --max-shapes must be >= 1, --max-len >= "
                     "--min-len, --median > 0, --sigma >= 0, --alpha > 0, --tail-splits 0..8")
    buckets = tuple(2**i for i in range(5, 13))
    model = dict(PRESETS[args.preset])
    if args.quick:  # seconds: a one-layer model, a short ladder, one step (a trace: two)
        limit = 64 if args.lengths else 32
        args.trajectories, args.median, args.sigma = min(args.trajectories, limit), 40.0, 0.8
        args.min_len, args.max_len, args.token_budget = 4, 128, 256
        args.group_size, args.groups_per_batch = 4, 8
        buckets = (64, 128)
        model = dict(d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
    # Compile time is part of what this measures: no persistent cache, whatever the CLI set.
    jax.config.update("jax_enable_compilation_cache", False)
    compiles.install()
    rng = np.random.default_rng(args.seed)
    try:
        lengths = read_lengths(args.lengths) if args.lengths else sample_lengths(args, rng)
    except (OSError, ValueError) as error:
        print(f"headrace bench packing: {error}", file=sys.stderr)
        return 2
    if args.lengths:
        lengths = lengths[:args.trajectories]
        if args.quick:  # 4,096 tokens -> 128: the quick ladder, the trace's spread of lengths
            lengths = np.maximum(lengths * buckets[-1] // 4096, 2)
    if args.ladder == "auto":
        buckets = auto_ladder(lengths, buckets[-1], args.token_budget, args.tail_splits,
                              args.max_shapes, smallest=min(32, buckets[0]))
    cfg = config_lib.load(data={
        "run": {"seed": args.seed},
        "model": {"preset": "custom", "max_len": buckets[-1], **model},
        "learner": {"groups_per_batch": args.groups_per_batch, "minibatches": 1,
                    "token_budget": args.token_budget, "optimizer": {"lr": 1e-3}},
        "shapes": {"buckets": list(buckets), "tail_splits": args.tail_splits}})
    dims = ModelDims.from_config(cfg.model, VOCAB)
    groups = make_groups(lengths, args.group_size, args.seed)
    print(f"packing bench: {len(lengths)} trajectories (mean length {lengths.mean():.0f}, max "
          f"{lengths.max()}; {int((lengths > buckets[-1]).sum())} truncated to the largest bucket), "
          f"{len(groups)} groups, {args.groups_per_batch} groups per step, "
          f"token budget {args.token_budget}, buckets {list(buckets)}, tail splits "
          f"{args.tail_splits}, model "
          f"d={dims.d_model} x{dims.n_layers}", file=sys.stderr)
    clock = CompileClock()
    result, trained = {}, {}
    for way in ways:
        result[way], trained[way] = run_way(way, groups, cfg, dims, clock)
        print(f"  {way}: " + ", ".join(f"{k} {v:.4g}" for k, v in result[way].items()),
              file=sys.stderr, flush=True)
    if len(set(trained.values())) != 1:
        raise RuntimeError(f"the ways trained on different token counts: {trained}")
    policy = ShapePolicy(buckets, args.token_budget, tail_splits=args.tail_splits)
    result["setup"] = {"buckets": list(buckets), "tail_splits": args.tail_splits,
                       "policy_shapes": len(policy.shapes()), "trajectories": int(len(lengths)),
                       "median_length": float(np.median(lengths)),
                       "max_length": int(lengths.max())}
    emit(result, as_json=args.json, title="packing: bucketed vs pad_to_max vs per_length")
    return 0


if __name__ == "__main__":
    sys.exit(main())
