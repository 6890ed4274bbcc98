"""Entry points of the learner and actor processes (spawned by the processes launcher).

Each child ties its life to the supervisor (SIGKILL when the parent dies, Linux PR_SET_PDEATHSIG),
turns SIGTERM/SIGINT into its stop event, pins itself to its CPUs and limits XLA's threads before
JAX is imported, then builds its component from the config and runs it. Metrics go to Redis
(`headrace.metrics.remote`). A child that fails logs the error and exits non-zero; the supervisor
restarts actors with backoff and ends the run when the learner fails.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pathlib
import signal
import sys
import threading
from typing import Any

PR_SET_PDEATHSIG = 1


def _setup(name: str, cpus: tuple[int, ...], xla_threads: int) -> threading.Event:
    # stdout belongs to the supervisor (`--json` prints one object there): a child's output, even
    # from C++ libraries (Gloo's connection messages), goes to stderr.
    sys.stdout.flush()
    os.dup2(2, 1)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the supervisor died before we got here
        sys.exit(1)
    if cpus:
        os.sched_setaffinity(0, cpus)
    if xla_threads:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (f"{flags} --xla_cpu_multi_thread_eigen=false "
                                   f"intra_op_parallelism_threads={xla_threads}").strip()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s")
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    return stop


def _common(config_data: dict[str, Any], run_dir: str):
    from headrace.config import load
    from headrace.runtime import build

    config = load(data=config_data)
    task = build.build_task(config)
    weights = build.make_weights(config, run_dir)
    return config, task, weights


def learner_main(config_data: dict[str, Any], run_dir: str, url: str, run_id: str,
                 cpus: tuple[int, ...], process_id: int = 0, processes: int = 1,
                 coordinator: str = "") -> None:
    """One learner process; with `processes` > 1, process `process_id` of a jax.distributed job
    whose coordinator listens on `coordinator` (host:port)."""
    name = "learner" if processes == 1 else f"learner-{process_id}"
    stop = _setup(name, cpus, 1 if cpus else 0)
    if processes > 1:
        from headrace.parallel import multihost

        multihost.initialize(coordinator, processes, process_id)  # before any computation
    from headrace.learner.loop import Learner
    from headrace.metrics.core import Metrics
    from headrace.metrics.remote import Publisher
    from headrace.runtime import build, resume
    from headrace.runtime.checkpoint import Checkpointer

    config, task, weights = _common(config_data, run_dir)
    buffer = build.make_buffer(config, url=url, run_id=run_id, consumer=f"learner-{process_id}")
    graphdef, params = build.init_params(config, task)
    metrics = Metrics()
    publisher = Publisher(buffer.client, run_id, name, metrics, extra=buffer.stats).start()
    admission = build.make_admission(config, buffer, url=url, run_id=run_id)
    # Crash safety: restore the latest checkpoint of the run folder, if any (a resumed run).
    # Every learner process opens it: each saves and restores its own shards.
    checkpointer = Checkpointer(pathlib.Path(run_dir) / resume.CHECKPOINT_DIR,
                                keep=resume.CHECKPOINTS_KEPT)
    ledger = resume.Ledger(pathlib.Path(run_dir) / resume.LEDGER_DIR,
                           process_id if processes > 1 else None) if config.run.ledger else None
    try:
        learner = Learner(config, graphdef, params, buffer, weights, metrics, stop,
                          allowed_v=task.sampler_settings.allowed_mask(task.dims.vocab_size),
                          admission=admission, checkpointer=checkpointer, ledger=ledger,
                          trace_path=build.trace_path(config, pathlib.Path(run_dir))
                          if process_id == 0 else None)
        learner.publish_start()  # version 0, or the restored weights after a resume
        learner.run()
    finally:
        publisher.stop()
        buffer.close()
        checkpointer.close()
        if ledger is not None:
            ledger.close()


def actor_main(config_data: dict[str, Any], run_dir: str, url: str, run_id: str, index: int,
               cpus: tuple[int, ...]) -> None:
    stop = _setup(f"actor-{index}", cpus, 0)
    from headrace.actor.actor import Actor
    from headrace.metrics.core import Metrics
    from headrace.metrics.remote import Publisher
    from headrace.model import params as params_lib
    from headrace.runtime import build

    config, task, weights = _common(config_data, run_dir)
    name = f"actor-{index}"
    buffer = build.make_buffer(config, url=url, run_id=run_id, consumer=name)
    metrics = Metrics()
    publisher = Publisher(buffer.client, run_id, name, metrics, extra=buffer.stats).start()
    graphdef = params_lib.graphdef(task.dims)
    sampler = build.make_sampler(config, task, graphdef, seed=config.run.seed + 100 + index,
                                 acting=True)
    try:
        admission = build.make_admission(config, buffer, url=url, run_id=run_id)
        Actor(config, name, task.make_env, task.tokenizer, sampler, buffer, weights, metrics,
              stop, admission).run()
    finally:
        publisher.stop()
        buffer.close()




def probe_main(config_data: dict[str, Any], cpus: tuple[int, ...], rows: tuple[int, ...],
               lengths: tuple[int, ...], repeats: int, window_s: float, conn) -> None:
    """Times the actor's sampler on calls of each row count (`headrace.audit.probe`), set up as
    an actor is (its CPUs; kept caches as `sampling.keep_cache` says), then measures an actor's
    turn-side CPU at two loads over `window_s` each (`probe.measure_turns`); sends {"calls":
    [(rows, seconds)...], "turns": [(turns/s, calls/s, cores)...]} through `conn`. Each row
    count plays `repeats` episodes in lockstep, one call per turn at that turn's context length,
    after one untimed episode that compiles their programs. Fresh weights: a call's cost does not
    depend on their values."""
    _setup("probe", cpus, 0)
    import time

    import numpy as np

    from headrace.audit import probe
    from headrace.config import load, replace
    from headrace.runtime import build

    config = load(data=config_data)
    if config.sampling.keep_cache:  # a slot per probed row: a call reads only its rows' slots
        g = config.actor.group_size  # (as many as the actor's: its programs, maybe cached)
        config = replace(config, actor={"envs_per_actor": max(config.actor.envs_per_actor,
                                                              -(-max(rows) // g) * g)})
    task = build.build_task(config)
    graphdef, params = build.init_params(config, task)
    sampler = build.make_sampler(config, task, graphdef, seed=config.run.seed, acting=True,
                                 background_compiles=False)
    sampler.set_params(params, 0)
    rng = np.random.default_rng(config.run.seed)
    vocab, limit = task.dims.vocab_size, sampler.max_context()

    def episode(n: int) -> list[float]:
        """Seconds of each turn's call: a context extends the last one by what was generated
        and an observation, up to the turn's length (so kept caches continue, as in a run)."""
        slots = list(range(n)) if sampler.episodes else None
        contexts, generated, seconds = [[] for _ in range(n)], [[] for _ in range(n)], []
        for length in lengths:
            contexts = [(c + list(g) + rng.integers(0, vocab, max(0, length - len(c) - len(g)))
                         .tolist())[:limit] for c, g in zip(contexts, generated)]
            start = time.perf_counter()
            generated, _, _ = sampler.generate(contexts, slots=slots)
            seconds.append(time.perf_counter() - start)
        return seconds

    timed = []
    for n in rows:
        episode(n)  # compiles this row count's programs: not timed
        for _ in range(repeats):
            timed.extend((n, s) for s in episode(n))
    try:
        turns = probe.measure_turns(config, sampler, params, window_s)
    except Exception:  # the timed calls still count; the audit then charges turns as measured
        logging.getLogger(__name__).exception("probe: the actor's turn CPU was not measured")
        turns = []
    sampler.close()
    conn.send({"calls": timed, "turns": turns})
