"""Next-token log-probs and entropies from the final hidden states, a chunk of tokens at a time.

A microbatch's float32 logits are tokens x vocabulary: at SmolLM2's 49,152 tokens 192 KiB a token,
6 GiB for 32 rows of 1,024, and the log-softmax, its exponential and the gradient are as large
again. `learner.logits_mib` bounds them: the microbatch's tokens are cut into k equal chunks of at
most that many MiB of logits (the last padded), and `jax.lax.map` runs the projection and the
log-softmax of one chunk at a time under `jax.checkpoint`, so the backward pass recomputes a chunk's
logits instead of keeping them. What is kept is the hidden states (tokens x d) and the per-token
results. Each token's log-softmax is its own, so the values do not depend on the chunking; the
gradient of the projection is summed over chunks (float32 sums in another order).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

MiB = 2 ** 20


def chunk_tokens(vocab: int, logits_mib: int) -> int:
    """Tokens per chunk whose float32 logits fit `logits_mib` MiB (0: no chunking)."""
    return max(1, logits_mib * MiB // (4 * vocab)) if logits_mib else 0


def chunked(fn: Callable, x_btd: jax.Array, targets_bt: jax.Array, chunk: int):
    """`fn(x [1, n, d], targets [1, n]) -> (logp [1, n], entropy [1, n])` over all b x t tokens
    of `x_btd`, at most `chunk` tokens per call (0, or no more tokens than that: one call on the
    whole array, as it is)."""
    b, t, d = x_btd.shape
    n = b * t
    if not chunk or n <= chunk:
        return fn(x_btd, targets_bt)
    k = -(-n // chunk)
    size = -(-n // k)  # k chunks of equal size, the least padding
    pad = k * size - n
    x = jnp.pad(x_btd.reshape(n, d), ((0, pad), (0, 0))).reshape(k, 1, size, d)
    y = jnp.pad(targets_bt.reshape(n), (0, pad)).reshape(k, 1, size)
    logp, entropy = jax.lax.map(jax.checkpoint(lambda xy: fn(*xy)), (x, y))
    return logp.reshape(-1)[:n].reshape(b, t), entropy.reshape(-1)[:n].reshape(b, t)
