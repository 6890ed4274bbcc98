"""Token-level policy-gradient losses with off-policy corrections, as small pure functions.

Every function takes per-token arrays of one shape (`logp` under the current policy, `behaviour` the
actor's recorded log-probs, `adv` advantages) and returns the per-token loss plus per-token
diagnostics; aggregation (token mean, sequence mean) is a weight array the batcher computes, so the
same functions serve gradient accumulation over microbatches. With behaviour == current policy every
variant has the on-policy policy gradient -A * grad(logp).

Sequence level (`learner.loss.level: sequence`, GSPO, Zheng et al. 2025): every importance ratio is
the geometric mean of its sequence's token ratios, exp(mean over the sequence's loss tokens of the
log-ratio), shared by all its tokens; clipping and truncation then act on whole sequences. The
`level` argument of each loss maps a per-token log-ratio to the log-ratio it uses (the identity at
token level; `sequence_mean` at sequence level; `sequence_prefix` at prefix level), so one
function serves every level.

Prefix level (`learner.loss.level: prefix`, per-decision importance sampling, Precup et al. 2000):
a token's ratio is the product of the ratios of its sequence's loss tokens up to and including it,
so it also corrects for the states that earlier actions of a stale policy led to (the turns of a
multi-turn episode), which a token's own ratio ignores. The earlier factors carry no gradient
(sg(prod_{j<t} rho_j) * rho_t), so on-policy the gradient is the token-level one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from headrace.config import LossConfig
from headrace.model.distribution import policy_logits


def token_logprobs(logits_btv: jax.Array, targets_bt: jax.Array, temperature: float,
                   allowed_v: jax.Array | None = None):
    """Log-prob of each target and the entropy under the policy distribution (`policy_logits`)."""
    logp_btv = jax.nn.log_softmax(policy_logits(logits_btv, temperature, allowed_v), axis=-1)
    logp_bt = jnp.take_along_axis(logp_btv, targets_bt[..., None], axis=-1)[..., 0]
    entropy_bt = -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)
    return logp_bt, entropy_bt


def _token(log_ratio):
    return log_ratio


def sequence_mean(values_bt, segment_ids_bt, on_bt):
    """Per token, the mean of `values` over the loss tokens (`on`) of its sequence (segment ids
    restart per row of a packed microbatch; 0 is padding). Differentiable in `values`."""
    rows, width = values_bt.shape
    key = (jnp.arange(rows)[:, None] * width + segment_ids_bt).reshape(-1)
    on = on_bt.reshape(-1).astype(values_bt.dtype)
    sums = jax.ops.segment_sum(values_bt.reshape(-1) * on, key, num_segments=rows * width)
    counts = jax.ops.segment_sum(on, key, num_segments=rows * width)
    return (sums / jnp.maximum(counts, 1.0))[key].reshape(rows, width)


def sequence_prefix(values_bt, segment_ids_bt, on_bt):
    """Per token, the sum of `values` over the loss tokens (`on`) of its sequence up to and
    including it (segments are contiguous runs of one id within a row; 0 is padding), with the
    gradient of the token's own value only: sg(prefix - own) + own."""
    rows, width = values_bt.shape
    own = values_bt * on_bt.astype(values_bt.dtype)
    through = jnp.cumsum(own, axis=1)
    key = (jnp.arange(rows)[:, None] * width + segment_ids_bt).reshape(-1)
    index = jnp.arange(rows * width)
    first = jax.ops.segment_min(index, key, num_segments=rows * width)[key]
    before_segment = (through - own).reshape(-1)[first].reshape(rows, width)
    earlier = jax.lax.stop_gradient(through - before_segment - own)
    return earlier + values_bt


def no_correction(logp, behaviour, adv, config: LossConfig, prox=None, level=_token):
    """REINFORCE with a baseline (Williams 1992): ignores that the data may be off-policy."""
    del behaviour, config, prox, level
    return -adv * logp, jnp.zeros_like(logp, dtype=bool)


def truncated_is(logp, behaviour, adv, config: LossConfig, prox=None, level=_token):
    """Truncated importance weights min(rho, rho_max), stop-gradient (IMPALA, Espeholt et al. 2018;
    TIS as used for LLM RL, Yao et al. 2025)."""
    del prox
    rho = jnp.exp(level(logp - behaviour))
    weight = jax.lax.stop_gradient(jnp.minimum(rho, config.rho_max))
    return -weight * adv * logp, rho > config.rho_max


def _clipped_surrogate(ratio, adv, config: LossConfig):
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1 - config.clip_eps, 1 + config.clip_eps) * adv
    surrogate = jnp.minimum(unclipped, clipped)
    if config.dual_clip:
        surrogate = jnp.where(adv < 0, jnp.maximum(surrogate, config.dual_clip * adv), surrogate)
    return surrogate, clipped < unclipped


def ppo_clip(logp, behaviour, adv, config: LossConfig, prox=None, level=_token):
    """PPO clipped ratio against the behaviour policy (Schulman et al. 2017), with the dual clip for
    negative advantages (Ye et al. 2020)."""
    del prox
    surrogate, clipped = _clipped_surrogate(jnp.exp(level(logp - behaviour)), adv, config)
    return -surrogate, clipped


def decoupled(logp, behaviour, adv, config: LossConfig, prox=None, level=_token):
    """Decoupled PPO (Hilton et al. 2022; AReaL, Fu et al. 2025): the trust region is around a
    proximal policy `prox` (the learner's weights at the start of the step); the behaviour ->
    proximal mismatch is corrected by a truncated, stop-gradient importance weight."""
    weight = jax.lax.stop_gradient(jnp.minimum(jnp.exp(level(prox - behaviour)), config.rho_max))
    surrogate, clipped = _clipped_surrogate(jnp.exp(level(logp - prox)), adv, config)
    return -weight * surrogate, clipped


LOSSES = {"none": no_correction, "truncated_is": truncated_is, "ppo_clip": ppo_clip,
          "decoupled": decoupled}


def kl_to_reference(logp, ref_logp):
    """Per-token KL(pi || ref) estimate k3 = exp(r) - r - 1, r = ref - logp (Schulman 2020)."""
    r = ref_logp - logp
    return jnp.exp(r) - r - 1


def importance_stats(logp, behaviour, weight):
    """is/* metrics over loss tokens (`weight` > 0): ratio mean and max, normalised ESS."""
    on = weight > 0
    n = jnp.maximum(jnp.sum(on), 1)
    rho = jnp.where(on, jnp.exp(logp - behaviour), 0.0)
    ess = jnp.square(jnp.sum(rho)) / (n * jnp.maximum(jnp.sum(rho * rho), 1e-30))
    return {"is/ratio_mean": jnp.sum(rho) / n, "is/ratio_max": jnp.max(rho), "is/ess": ess}
