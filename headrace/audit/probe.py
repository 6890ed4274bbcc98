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

This module holds the probe's arithmetic; running it (the child process, the actor) is the
composition root's work: `headrace.runtime.probe`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PROBE_ROWS = (1, 8, 32, 128, 512)
PROBE_TOKENS = 65_536  # context tokens per probed call at most (long contexts probe fewer rows)


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
