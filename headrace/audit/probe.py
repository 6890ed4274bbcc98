"""The sampler's cost beyond the batches a measurement saw.

A small pool's policy calls hold a row or two, all padded to the same row bucket, so their cost
says nothing of a large pool's calls of hundreds of rows. The probe times the actor's sampler on
calls of growing row counts, in a child process set up as an actor is (`run.actor_cpus`, kept
caches as `sampling.keep_cache` says): each row count plays episodes in lockstep, one call per
turn at the measured episodes' context lengths, so with kept caches the first turn computes its
context and the later ones only what was added. The audit fits its call cost over the traced
calls and these together.

The same child then runs an actor (the actor's own code, with a stand-in buffer and weight
store) at two loads, to split its turn-side CPU (event loop, environment steps, puts) into a part
per policy call and a part per turn: a call's part is spread over fewer turns when calls batch
more rows, so a turn costs less in a large pool than in a small one (`split_turn_cpu`).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import threading
import time

import numpy as np

from headrace.config import Config, replace

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 8, 32, 128, 512)
PROBE_TOKENS = 65_536  # context tokens per probed call at most (long contexts probe fewer rows)
PROBE_TIMEOUT_S = 300.0
# The actor's two loads: (environments, median injected step latency in seconds). Few slow
# environments make calls of a row or two; many fast ones saturate the core with large calls.
TURN_LOADS = ((64, 0.2), (512, 0.02))
TURN_START_TIMEOUT_S = 120.0  # for the actor's first call (it may precompile first)
TURN_WARMUP_S, TURN_WINDOW_S = 2.0, 6.0


@dataclasses.dataclass(frozen=True)
class Probed:
    calls: np.ndarray  # [n, 2]: rows, seconds of timed sampler calls
    turns: np.ndarray  # [k, 3]: turns/s, policy calls/s, turn-side CPU (cores) at k loads


def context_lengths(episode_tokens: float, turns: float, limit: int) -> tuple[int, ...]:
    """A turn's context at each turn of an average episode: evenly from one turn's share of
    the episode's tokens to all of them (at most `limit`)."""
    turns = max(1, round(turns))
    ends = np.linspace(max(1.0, episode_tokens / turns), max(1.0, episode_tokens), turns)
    return tuple(int(min(limit, max(1, round(x)))) for x in ends)


def probe(config: Config, lengths: tuple[int, ...], repeats: int = 3,
          timeout_s: float = PROBE_TIMEOUT_S, window_s: float = TURN_WINDOW_S) -> Probed:
    """Timed sampler calls up to `actor.max_batch` rows (and PROBE_TOKENS context tokens):
    `repeats` episodes of a call per turn (`lengths`: a turn's context) at each row count; then
    the actor's turn-side CPU at TURN_LOADS, each over `window_s`. Empty (and logged) when the
    probe fails or runs past `timeout_s`: the audit then fits the traced calls alone and charges
    turns as measured."""
    from headrace.runtime import worker

    most = min(config.actor.max_batch, max(1, PROBE_TOKENS // max(lengths)))
    rows = tuple(r for r in PROBE_ROWS if r <= most)
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=worker.probe_main, name="probe", daemon=True,
                          args=(config.to_dict(), tuple(config.run.actor_cpus), rows, lengths,
                                repeats, window_s, send))
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
    from headrace.actor.cpu import TurnCpu
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
            end = (time.monotonic(), rows.total, rows.count, cpu.read())
        finally:
            stop.set()
            thread.join(30.0)
        elapsed = end[0] - start[0]
        points.append(tuple((b - a) / elapsed for a, b in zip(start[1:], end[1:])))
    return points


def split_turn_cpu(points: np.ndarray) -> tuple[float, float]:
    """(per_turn_s, per_call_s): CPU = per_turn x turns/s + per_call x calls/s over the probed
    loads ([k, 3]: turns/s, calls/s, cores), least squares, both >= 0; (0, 0) without points."""
    if len(points) == 0:
        return 0.0, 0.0
    x, cpu = points[:, :2], points[:, 2]
    if len(points) >= 2 and np.linalg.matrix_rank(x) == 2:
        per_turn, per_call = np.linalg.lstsq(x, cpu, rcond=None)[0]
        if per_turn >= 0 and per_call >= 0:
            return float(per_turn), float(per_call)
    # one regressor alone: the one that explains more
    fits = [(float(cpu @ x[:, i] / (x[:, i] @ x[:, i])) if x[:, i] @ x[:, i] > 0 else 0.0, i)
            for i in (0, 1)]
    errors = [np.sum((cpu - k * x[:, i]) ** 2) for k, i in fits]
    k, i = fits[int(np.argmin(errors))]
    return (k, 0.0) if i == 0 else (0.0, k)
