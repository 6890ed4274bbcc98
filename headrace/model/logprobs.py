"""Next-token log-probs and entropies from the final hidden states, a chunk of tokens at a time.

A microbatch's float32 logits are tokens x vocabulary: at SmolLM2's 49,152 tokens 192 KiB a token,
6 GiB for 32 rows of 1,024, and the log-softmax, its exponential and the gradient are as large
again. `learner.logits_mib` bounds them: the microbatch's tokens are cut into k equal chunks of at
most that many MiB of logits (the last padded), and `jax.lax.map` runs the projection and the
log-softmax of one chunk at a time under `jax.checkpoint`, so the backward pass recomputes a chunk's
logits instead of keeping them. What is kept is the hidden states (tokens x d) and the per-token
results. Each token's log-softmax is its own, so the values do not depend on the chunking; the
gradient of the projection is summed over chunks (float32 sums in another order).

Given `on` (the learner's loss tokens: the only positions whose results it uses), the tokens are
first reordered so those come first, and a chunk holding none of them is skipped (`lax.cond`: its
results are 0 and it costs nothing forward or backward). Prompts, tool results and padding are
most of a row (75 % of the SmolLM2 example's slots), so the projection and log-softmax, a fifth
of SmolLM2's arithmetic, then run on about the chunks the loss tokens fill rather than on all.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

MiB = 2 ** 20


def chunk_tokens(vocab: int, logits_mib: int) -> int:
    """Tokens per chunk whose float32 logits fit `logits_mib` MiB (0: no chunking)."""
    return max(1, logits_mib * MiB // (4 * vocab)) if logits_mib else 0


def loss_positions(mb: dict) -> jax.Array | None:
    """bool [b, t-1]: the next-token positions whose results a learner microbatch uses (its
    `weight` > 0), or None for a microbatch without weights (every result is used)."""
    return mb["weight"][:, 1:] > 0 if "weight" in mb else None


def chunked(fn: Callable, x_btd: jax.Array, targets_bt: jax.Array, chunk: int,
            on_bt: jax.Array | None = None):
    """`fn(x [1, n, d], targets [1, n]) -> (logp [1, n], entropy [1, n])` over all b x t tokens
    of `x_btd`, at most `chunk` tokens per call (0, or no more tokens than that: one call on the
    whole array, as it is). With `on_bt` (bool [b, t]) chunks without a position it marks are
    skipped: an unmarked position's results are its own or 0."""
    b, t, d = x_btd.shape
    n = b * t
    if not chunk or n <= chunk:
        return fn(x_btd, targets_bt)
    k = -(-n // chunk)
    size = -(-n // k)  # k chunks of equal size, the least padding
    pad = k * size - n
    x, y = jnp.asarray(x_btd).reshape(n, d), jnp.asarray(targets_bt).reshape(n)
    if on_bt is not None:
        on = jnp.asarray(on_bt).reshape(n)
        order = jnp.argsort(~on, stable=True)  # marked positions first
        x, y = x[order], y[order]
        live = jnp.pad(on[order], (0, pad)).reshape(k, size).any(axis=1)
    x = jnp.pad(x, ((0, pad), (0, 0))).reshape(k, 1, size, d)
    y = jnp.pad(y, (0, pad)).reshape(k, 1, size)
    if on_bt is None:
        logp, entropy = jax.lax.map(jax.checkpoint(lambda xy: fn(*xy)), (x, y))
    else:
        def one(xy_live):
            xc, yc, alive = xy_live
            skipped = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, xc, yc))
            return jax.lax.cond(alive, fn, lambda *_: skipped, xc, yc)

        logp, entropy = jax.lax.map(jax.checkpoint(one), (x, y, live))
    logp, entropy = logp.reshape(-1)[:n], entropy.reshape(-1)[:n]
    if on_bt is not None:  # back to the tokens' own order
        logp, entropy = (jnp.zeros_like(v).at[order].set(v) for v in (logp, entropy))
    return logp.reshape(b, t), entropy.reshape(b, t)
