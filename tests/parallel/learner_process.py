"""One learner process of `test_multihost.py`: trains fixed groups, saves what it computed.

python -m tests.parallel.learner_process PROCESS_ID PROCESSES PORT OUT_DIR [STEPS [CKPT_DIR]]

Every process builds the same groups (4 a step) and the same initial weights; process i of P gets,
for each step, its share of that step's groups in its own buffer, exactly as each learner process
of a job is one consumer of the buffer. Training runs to learner step STEPS (default 2). With
CKPT_DIR the learner checkpoints every step there, and first restores the latest checkpoint in it,
if any (a resumed job then gets only the groups of the steps after it). Process 0 writes the final
parameters and the metrics of every step this job trained to OUT_DIR/result.npz. With PRECOMPILE=1
in the environment the learner runs `learner.precompile` (with a token budget: fixed rows).
"""

from __future__ import annotations

import itertools
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"  # 2 devices a process

GROUPS_PER_BATCH = 4


def main(process_id: int, processes: int, port: int, out_dir: str, steps: int = 2,
         ckpt_dir: str | None = None) -> None:
    if processes > 1:
        from headrace.parallel import multihost

        multihost.initialize(f"127.0.0.1:{port}", processes, process_id)
    import threading

    import numpy as np

    from headrace.buffer.memory import MemoryBuffer
    from headrace.config import load
    from headrace.learner.checkpoint import Checkpointer
    from headrace.metrics.core import Metrics
    from headrace.model import params as params_lib
    from headrace.parallel import multihost
    from headrace.runtime import build
    from headrace.weights.memory import MemoryWeightStore
    from tests.learner.test_checkpointing import make_group

    overrides = [f"learner.groups_per_batch={GROUPS_PER_BATCH}", "learner.minibatches=1",
                 "learner.entropy_coef=0.01", "buffer.max_pending=64",
                 f"run.max_steps={steps}", "run.checkpoint_every=1",
                 "staleness.max_policy_lag=100", f"parallel.processes={processes}",
                 "parallel.mesh={data: -1}" if processes > 1 else "parallel.mesh={data: 1}"]
    if os.environ.get("PRECOMPILE") == "1":  # every shape compiled ahead (fixed rows: a budget)
        overrides += ["learner.precompile=true", "learner.token_budget=128"]
    config = load("examples/guess_number.yaml", overrides)
    task = build.build_task(config)
    graphdef, params = build.init_params(config, task)
    allowed = task.sampler_settings.allowed_mask(task.dims.vocab_size)
    buffer = MemoryBuffer(capacity=100, max_pending=64)
    checkpointer = Checkpointer(ckpt_dir) if ckpt_dir else None
    first = (checkpointer.latest_step() or 0) if checkpointer else 0
    share = GROUPS_PER_BATCH // processes
    mine = [make_group(step * GROUPS_PER_BATCH + process_id * share + k, np.flatnonzero(allowed))
            for step in range(first, steps) for k in range(share)]
    # A stream's ids never repeat: a resumed job's buffer carries on after the first job's ids
    # (the checkpoint's handled ids are skipped if they come again).
    buffer._ids = itertools.count(1 + first * share)
    buffer.put(mine, timeout_s=1)
    metrics = Metrics()
    learner = build.make_learner(config, task, graphdef, params, buffer, MemoryWeightStore(4),
                                 metrics, threading.Event(), checkpointer=checkpointer)
    assert learner.step == first, (learner.step, first)
    recorded = []
    finish = learner._finish_step

    def record(step_metrics, *rest):
        recorded.append({k: float(v) for k, v in step_metrics.items()})
        finish(step_metrics, *rest)

    learner._finish_step = record
    slow_s = float(os.environ.get("SLOW_FIRST_PROGRAM_S", 0))
    if slow_s and process_id == 1:  # a compile slower than Gloo's 30 s, here alone
        train_step, compile_program = learner._train_step, learner._train_step._compile

        def slow_compile(carry):
            program = compile_program(carry)

            def first_call(*args):
                time.sleep(slow_s)
                train_step._step = program
                return program(*args)

            return first_call

        train_step._compile = slow_compile
    learner.publish_start()
    learner.run()
    if checkpointer is not None:
        checkpointer.close()
    assert buffer.pending() == 0  # every entry acknowledged after the final checkpoint
    final = learner.state.params
    final = multihost.host_params(final) if processes > 1 else final
    if process_id == 0:
        flat = params_lib.to_host(final)
        keys = sorted(recorded[0])
        np.savez(os.path.join(out_dir, "result.npz"),
                 metrics=np.array([[m[k] for k in keys] for m in recorded]),
                 metric_names=np.array(keys), **{f"param/{k}": v for k, v in flat.items()},
                 precompile_s=metrics.gauges.get("learner/precompile_s", 0.0),
                 compile_s=metrics.gauges["learner/compile_s"])


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
         *([int(sys.argv[5])] if len(sys.argv) > 5 else []), *sys.argv[6:7])
