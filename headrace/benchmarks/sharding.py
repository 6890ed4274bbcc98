"""Sharding benchmark: the sharded learner step on four mesh shapes vs the single-device step.

    headrace bench sharding [--steps 5] [--devices 8] [--quick] [--json]

For each mesh (data, fsdp, tensor) in (8,1,1), (1,8,1), (1,4,2), (2,2,2) it places a fresh train
state with the partition rules (`headrace.parallel`), runs the same batches as the plain jitted
single-device `TrainStep` (built by the real `Batcher` from synthetic groups: two minibatches,
two optimizer updates per step) and reports:

- param_bytes_per_device, opt_bytes_per_device: bytes of parameters and of optimizer state on the
  fullest device, summed over the live arrays' addressable shards (not computed from shapes);
- bytes_total: parameter + optimizer bytes of the whole model (one copy);
- per_device_vs_ideal: (param + opt bytes per device) / (bytes_total / (fsdp x tensor)); the
  target is <= 1.1;
- max_abs_diff_vs_single: the largest parameter difference from the single-device step after
  the first step (float32; Adam's normalisation turns rounding in near-zero gradients into
  differences up to ~lr, see tests/parallel/test_step.py);
- step_s: median seconds per step after the first (each microbatch waited for).

Devices are simulated CPU devices: with fewer than `--devices` devices the benchmark sets
XLA_FLAGS=--xla_force_host_platform_device_count (and JAX_PLATFORMS=cpu) before JAX starts, or
re-runs itself in a subprocess when JAX was already started with fewer devices.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

from headrace.benchlib import bench_parser, token_groups

MESHES = ((8, 1, 1), (1, 8, 1), (1, 4, 2), (2, 2, 2))
_CHILD = "HEADRACE_SHARDING_BENCH_CHILD"
_FLAG = "--xla_force_host_platform_device_count"


def _with_device_count(flags: str, count: int) -> str:
    flags = re.sub(rf"{_FLAG}=\d+", "", flags).strip()
    return f"{flags} {_FLAG}={count}".strip()


def ensure_devices(count: int, argv: list[str]) -> int | None:
    """Makes `count` devices available before JAX starts; None: go on in this process.

    Returns the exit code of a child run when JAX had already started with fewer devices (the
    CLI may have imported and configured it): the child gets the flags and reruns this benchmark.
    """
    started = False
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized()
    if not started:
        import jax

        if f"{_FLAG}={count}" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = _with_device_count(os.environ.get("XLA_FLAGS", ""), count)
            jax.config.update("jax_platforms", "cpu")  # what the flag simulates
    import jax

    if jax.device_count() >= count:
        return None
    if os.environ.get(_CHILD):
        raise RuntimeError(f"{jax.device_count()} devices after setting XLA_FLAGS; {count} needed")
    env = dict(os.environ, XLA_FLAGS=_with_device_count(os.environ.get("XLA_FLAGS", ""), count),
               JAX_PLATFORMS="cpu", **{_CHILD: "1"})
    print(f"bench sharding: JAX already started with {jax.device_count()} devices; rerunning "
          f"with {count} simulated CPU devices", file=sys.stderr)
    child = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "sharding", *argv],
                           env=env, check=False)
    return child.returncode


def run(args) -> list[dict]:
    import jax

    from headrace.config import LearnerConfig, LossConfig, ShapesConfig
    from headrace.learner.batching import Batcher
    from headrace.learner.sharded_step import ShardedTrainStep
    from headrace.learner.train_step import init_state, make_optimizer, make_train_step
    from headrace.metrics.core import Metrics
    from headrace.model import params as params_lib
    from headrace.model.transformer import ModelDims
    from headrace.parallel import rules
    from headrace.parallel.mesh import make_mesh

    if args.quick:
        dims = ModelDims(vocab_size=64, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=128)
        width, groups_per_step = 32, 4
    else:
        dims = ModelDims(vocab_size=512, d_model=256, n_layers=4, n_heads=8, n_kv_heads=8,
                         d_ff=1024)
        width, groups_per_step = 128, 8
    learner = LearnerConfig(groups_per_batch=groups_per_step, minibatches=2,
                            loss=LossConfig(kind="ppo_clip"))
    batcher = Batcher(learner, ShapesConfig(buckets=(width,), rows_per_bucket=8), Metrics())
    batches = [batcher.build(token_groups(groups_per_step, dims.vocab_size, seed, max_len=width))
               for seed in range(1 + args.steps)]
    graphdef, params = params_lib.init(dims, 0)
    params = jax.device_get(params)
    optimizer = make_optimizer(learner.optimizer)
    single = make_train_step(graphdef, learner, 1.0, optimizer)
    want, _ = single(init_state(params, optimizer, 0.0), batches[0])
    want = params_lib.flatten(jax.device_get(want.params))
    print(f"sharding bench: {jax.device_count()} devices, model d={dims.d_model} "
          f"x{dims.n_layers} ({params_lib.count(params):,} params), microbatches "
          f"{batches[0].shapes}, {len(batches[0].microbatches)} per step", file=sys.stderr)
    rows = []
    for data, fsdp, tensor in MESHES:
        mesh = make_mesh({"data": data, "fsdp": fsdp, "tensor": tensor}, jax.devices()[:8])
        step = ShardedTrainStep(graphdef, learner, 1.0, optimizer, mesh=mesh, dims=dims)
        state = step.place(init_state(params, optimizer, 0.0))
        param_b = rules.max_bytes_per_device(state.params)
        opt_b = rules.max_bytes_per_device(state.opt_state)
        total = sum(int(x.nbytes) for x in jax.tree.leaves((state.params, state.opt_state)))
        state, _ = step(state, batches[0], sync=True)
        got = params_lib.flatten(jax.device_get(state.params))
        diff = max(float(np.max(np.abs(got[k] - want[k]))) for k in want)
        times = []
        for batch in batches[1:]:
            start = time.perf_counter()
            state, metrics = step(state, batch, sync=True)
            jax.block_until_ready(metrics)  # timing: the whole step
            times.append(time.perf_counter() - start)
        rows.append({"data": data, "fsdp": fsdp, "tensor": tensor,
                     "param_bytes_per_device": param_b, "opt_bytes_per_device": opt_b,
                     "bytes_total": total,
                     "per_device_vs_ideal": (param_b + opt_b) * fsdp * tensor / total,
                     "max_abs_diff_vs_single": diff,
                     "step_s": statistics.median(times) if times else float("nan")})
    return rows


def _table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="headrace bench sharding", header_style="bold")
    for name in ("mesh (d,f,t)", "param B/dev", "opt B/dev", "total B", "vs ideal",
                 "max |diff|", "step s"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(f"{r['data']},{r['fsdp']},{r['tensor']}", f"{r['param_bytes_per_device']:,}",
                      f"{r['opt_bytes_per_device']:,}", f"{r['bytes_total']:,}",
                      f"{r['per_device_vs_ideal']:.3f}", f"{r['max_abs_diff_vs_single']:.2e}",
                      f"{r['step_s']:.4f}")
    Console(file=sys.stderr, width=120).print(table)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="headrace bench sharding", parents=[bench_parser()],
                                     description="sharded learner step on four mesh shapes")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mesh")
    parser.add_argument("--devices", type=int, default=8, help="simulated devices (>= 8)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.devices < 8:
        parser.error("--steps must be >= 1 and --devices >= 8 (the meshes use 8)")
    if args.quick:
        args.steps = min(args.steps, 2)
    code = ensure_devices(args.devices, argv)
    if code is not None:
        return code
    rows = run(args)
    _table(rows)
    if args.json:
        sys.stdout.write(json.dumps({"meshes": rows}, allow_nan=False) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
