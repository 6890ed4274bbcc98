"""Runs the sampler probe (`headrace.audit.probe` holds its arithmetic and says what it
measures): a child process set up as an actor is times the sampler on calls of growing row
counts, then runs an actor at two loads (`TURN_LOADS`) to measure its turn-side CPU."""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from typing import Any

import numpy as np

from headrace import placement
from headrace.audit.probe import PROBE_ROWS, PROBE_TOKENS, Probed
from headrace.config import Config, replace
from headrace.runtime import worker  # light: no JAX before the child's set-up

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 300.0
# The actor's two loads: (environments, median injected step latency in seconds). Few slow
# environments make calls of a row or two; many fast ones saturate the core with large calls.
TURN_LOADS = ((64, 0.2), (512, 0.02))
TURN_START_TIMEOUT_S = 120.0  # for the actor's first call (it may precompile first)
TURN_WARMUP_S, TURN_WINDOW_S = 2.0, 6.0
TURN_MIN_TICKS = 10  # turn-side CPU a window must hold, in /proc clock ticks (10 %: error)
TURN_EXTEND_S = 30.0  # how long a window is extended for them at most


def probe(config: Config, lengths: tuple[int, ...], repeats: int = 3,
          timeout_s: float = PROBE_TIMEOUT_S, window_s: float = TURN_WINDOW_S) -> Probed:
    """Timed sampler calls up to `actor.max_batch` rows (and PROBE_TOKENS context tokens):
    `repeats` episodes of a call per turn (`lengths`: a turn's context) at each row count; then
    the actor's turn-side CPU at TURN_LOADS, each over `window_s`. Empty (and logged) when the
    probe fails or runs past `timeout_s`: the audit then fits the traced calls alone and charges
    turns as measured."""
    most = min(config.actor.max_batch, max(1, PROBE_TOKENS // max(lengths)))
    rows = tuple(r for r in PROBE_ROWS if r <= most)
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    cpus = placement.actor_share(  # actor 0's, as launched
        placement.actor_cpus(config.run, placement.usable_cpus(), config.parallel.processes), 0,
        config.actor.num_actors)
    process = ctx.Process(target=probe_main, name="probe", daemon=True,
                          args=(config.to_dict(), cpus, rows, lengths, repeats, window_s, send))
    process.start()
    send.close()
    try:
        if receive.poll(timeout_s):
            answer = receive.recv()
            return Probed(np.array(answer["calls"], dtype=np.float64).reshape(-1, 2),
                          np.array(answer["turns"], dtype=np.float64).reshape(-1, 3))
        log.warning("probe: no answer within %.0f s (exit code %s); fitting the traced calls "
                    "alone", timeout_s, process.exitcode)
    except EOFError:
        log.warning("probe failed (exit code %s); fitting the traced calls alone",
                    process.exitcode)
    finally:
        process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join()
        receive.close()
    return Probed(np.zeros((0, 2)), np.zeros((0, 3)))


def measure_turns(config: Config, sampler, params,
                  window_s: float = TURN_WINDOW_S) -> list[tuple[float, float, float]]:
    """(turns/s, calls/s, turn-side CPU in cores) of an actor at each of TURN_LOADS over
    `window_s` (in the probe child): the configured environment with its injected latency (if
    any) replaced by the load's, the child's sampler, all groups kept in memory, no admission."""
    from headrace.actor.actor import Actor
    from headrace.actor.cpu import TICK_S, TurnCpu
    from headrace.buffer.memory import MemoryBuffer
    from headrace.metrics.core import Metrics
    from headrace.model import params as params_lib
    from headrace.runtime import build
    from headrace.weights.memory import MemoryWeightStore

    weights, host = MemoryWeightStore(), params_lib.to_host(params)
    g, points = config.actor.group_size, []
    for version, (envs, latency_s) in enumerate(TURN_LOADS, start=1):
        envs = max(g, min(envs, sampler.episodes or envs) // g * g)
        sections = {"actor": {"num_actors": 1, "envs_per_actor": envs}}
        if config.env.latency.kind != "none":
            sections["env"] = {"latency": {"kind": "lognormal", "seconds": latency_s,
                                           "sigma": config.env.latency.sigma}}
        c = replace(config, **sections)
        task = build.build_task(c)
        weights.publish(host, version)  # newer than the sampler's: the actor's first pickup
        metrics, stop = Metrics(), threading.Event()
        actor = Actor(c, "probe", task.make_env, task.tokenizer, sampler,
                      MemoryBuffer(capacity=1 << 30, max_pending=1 << 30), weights, metrics, stop)
        thread = threading.Thread(target=actor.run, name="probe-actor", daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + TURN_START_TIMEOUT_S
            while metrics.distribution("actor/batch_rows") is None:
                if time.monotonic() > deadline or not thread.is_alive():
                    raise RuntimeError("the probe's actor made no policy call")
                time.sleep(0.05)
            time.sleep(TURN_WARMUP_S)
            cpu = TurnCpu(prefix="probe-io", loop_thread=thread.native_id)
            rows = metrics.distribution("actor/batch_rows")
            start = (time.monotonic(), rows.total, rows.count, cpu.read())
            time.sleep(window_s)
            # A window without a completed call, or with only a few clock ticks of turn-side CPU
            # (the resolution /proc counts it in), measures nothing (a loaded machine, a slow
            # call, a short window): it is extended until both are there, for TURN_EXTEND_S.
            deadline = time.monotonic() + TURN_EXTEND_S
            while True:
                calls, used = rows.count - start[2], cpu.read() - start[3]
                enough = calls > 0 and used >= TURN_MIN_TICKS * TICK_S
                if enough or not thread.is_alive() or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            if not enough:
                log.warning("probe: %d environments: %.0f s gave %d policy calls and %.3f s of "
                            "turn-side CPU; the split of its CPU is uncertain", envs,
                            time.monotonic() - start[0], calls, used)
            end = (time.monotonic(), rows.total, rows.count, cpu.read())
        finally:
            stop.set()
            thread.join(30.0)
        elapsed = end[0] - start[0]
        points.append(tuple((b - a) / elapsed for a, b in zip(start[1:], end[1:])))
    return points


def probe_main(config_data: dict[str, Any], cpus: tuple[int, ...], rows: tuple[int, ...],
               lengths: tuple[int, ...], repeats: int, window_s: float, conn) -> None:
    """Times the actor's sampler on calls of each row count (`headrace.audit.probe`), set up as
    an actor is (its CPUs; kept caches as `sampling.keep_cache` says), then measures an actor's
    turn-side CPU at two loads over `window_s` each (`measure_turns`); sends {"calls":
    [(rows, seconds)...], "turns": [(turns/s, calls/s, cores)...]} through `conn`. Each row
    count plays `repeats` episodes in lockstep, one call per turn at that turn's context length,
    after one untimed episode that compiles their programs. Fresh weights: a call's cost does not
    depend on their values."""
    worker._setup("probe", cpus)  # the same process set-up as an actor's
    import time

    import numpy as np

    from headrace.config import load
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
        turns = measure_turns(config, sampler, params, window_s)
    except Exception:  # the timed calls still count; the audit then charges turns as measured
        log.exception("probe: the actor's turn CPU was not measured")
        turns = []
    sampler.close()
    conn.send({"calls": timed, "turns": turns})
