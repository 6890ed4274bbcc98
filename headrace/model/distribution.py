"""The policy's token distribution, shared by the sampler and the learner.

The policy is softmax(logits / temperature), restricted to the allowed tokens when decoding is
constrained to an environment's action vocabulary. The sampler records log-probs under exactly this
distribution and the learner evaluates exactly this one, so importance ratios are 1 on-policy.
(top-k and top-p only choose the token; they do not change the recorded distribution.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED_LOGIT = -1e9  # finite, so masked tokens have probability 0 and p * log p stays 0


def policy_logits(logits_btv: jax.Array, temperature: float, allowed_v: jax.Array | None):
    """The policy's distribution: temperature-scaled, restricted to the allowed tokens if any.

    Shared by the sampler and the learner, so behaviour log-probs and the learner's agree.
    """
    scaled_btv = logits_btv / temperature
    if allowed_v is None:
        return scaled_btv
    return jnp.where(allowed_v, scaled_btv, MASKED_LOGIT)
