"""The sampler's cost beyond the batches a measurement saw.

A small pool's policy calls hold a row or two, all padded to the same row bucket, so their cost
says nothing of a large pool's calls of hundreds of rows. The probe times the actor's sampler on
calls of growing row counts, in a child process set up as an actor is (`run.actor_cpus`, kept
caches as `sampling.keep_cache` says): each row count plays episodes in lockstep, one call per
turn at the measured episodes' context lengths, so with kept caches the first turn computes its
context and the later ones only what was added. The audit fits its call cost over the traced
calls and these together.
"""

from __future__ import annotations

import logging
import multiprocessing

import numpy as np

from headrace.config import Config

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 8, 32, 128, 512)
PROBE_TOKENS = 65_536  # context tokens per probed call at most (long contexts probe fewer rows)
PROBE_TIMEOUT_S = 300.0


def context_lengths(episode_tokens: float, turns: float, limit: int) -> tuple[int, ...]:
    """A turn's context at each turn of an average episode: evenly from one turn's share of
    the episode's tokens to all of them (at most `limit`)."""
    turns = max(1, round(turns))
    ends = np.linspace(max(1.0, episode_tokens / turns), max(1.0, episode_tokens), turns)
    return tuple(int(min(limit, max(1, round(x)))) for x in ends)


def probe_calls(config: Config, lengths: tuple[int, ...], repeats: int = 3,
                timeout_s: float = PROBE_TIMEOUT_S) -> np.ndarray:
    """[n, 2] (rows, seconds) of timed sampler calls up to `actor.max_batch` rows (and
    PROBE_TOKENS context tokens): `repeats` episodes of a call per turn (`lengths`: a turn's
    context) at each row count. Empty (and logged) when the probe fails or runs past
    `timeout_s`: the audit then fits the traced calls alone."""
    from headrace.runtime import worker

    most = min(config.actor.max_batch, max(1, PROBE_TOKENS // max(lengths)))
    rows = tuple(r for r in PROBE_ROWS if r <= most)
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=worker.probe_main, name="probe", daemon=True,
                          args=(config.to_dict(), tuple(config.run.actor_cpus), rows, lengths,
                                repeats, send))
    process.start()
    send.close()
    try:
        if receive.poll(timeout_s):
            return np.array(receive.recv(), dtype=np.float64).reshape(-1, 2)
        log.warning("sampler probe: no answer within %.0f s (exit code %s); fitting the traced "
                    "calls alone", timeout_s, process.exitcode)
    except EOFError:
        log.warning("sampler probe failed (exit code %s); fitting the traced calls alone",
                    process.exitcode)
    finally:
        process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join()
        receive.close()
    return np.zeros((0, 2))
