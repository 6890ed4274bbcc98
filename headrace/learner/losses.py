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


def no_correction(logp, behaviour, adv, config: LossConfig, prox=None, level=_token, on=None):
    """REINFORCE with a baseline (Williams 1992): ignores that the data may be off-policy."""
    del behaviour, config, prox, level, on
    return -adv * logp, jnp.zeros_like(logp, dtype=bool)


def truncated_is(logp, behaviour, adv, config: LossConfig, prox=None, level=_token, on=None):
    """Truncated importance weights min(rho, rho_max), stop-gradient (IMPALA, Espeholt et al. 2018;
    TIS as used for LLM RL, Yao et al. 2025)."""
    del prox, on
    rho = jnp.exp(level(logp - behaviour))
    weight = jax.lax.stop_gradient(jnp.minimum(rho, config.rho_max))
    return -weight * adv * logp, rho > config.rho_max


def _clipped_surrogate(ratio, adv, config: LossConfig):
    """PPO's surrogate, the ratio clipped to [1 - clip_eps, 1 + clip_eps_high] (DAPO's
    clip-higher, Yu et al. 2025, when the upper side is the wider; symmetric by default)."""
    unclipped = ratio * adv
    high = config.clip_eps_high or config.clip_eps
    clipped = jnp.clip(ratio, 1 - config.clip_eps, 1 + high) * adv
    surrogate = jnp.minimum(unclipped, clipped)
    if config.dual_clip:
        surrogate = jnp.where(adv < 0, jnp.maximum(surrogate, config.dual_clip * adv), surrogate)
    return surrogate, clipped < unclipped


def ppo_clip(logp, behaviour, adv, config: LossConfig, prox=None, level=_token, on=None):
    """PPO clipped ratio against the behaviour policy (Schulman et al. 2017), with the dual clip for
    negative advantages (Ye et al. 2020)."""
    del prox, on
    surrogate, clipped = _clipped_surrogate(jnp.exp(level(logp - behaviour)), adv, config)
    return -surrogate, clipped


def decoupled(logp, behaviour, adv, config: LossConfig, prox=None, level=_token, on=None):
    """Decoupled PPO (Hilton et al. 2022; AReaL, Fu et al. 2025): the trust region is around a
    proximal policy `prox` (the learner's weights at the start of the step); the behaviour ->
    proximal mismatch is corrected by a truncated, stop-gradient importance weight."""
    del on
    weight = jax.lax.stop_gradient(jnp.minimum(jnp.exp(level(prox - behaviour)), config.rho_max))
    surrogate, clipped = _clipped_surrogate(jnp.exp(level(logp - prox)), adv, config)
    return -weight * surrogate, clipped


def dppo_mask(logp, behaviour, adv, config: LossConfig, prox=None, level=_token, on=None):
    """Masked importance sampling with a divergence trust region (DPPO, Binary-TV variant: Qi et
    al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv 2602.04879; the
    ratio mask as in prime-rl's loss, Prime Intellect 2025).

    A token is masked (no gradient at all, rather than a clipped one) when its ratio
    rho = pi / mu against the behaviour policy leaves [mask_low, mask_high], or when the update
    would push it further out of the total-variation trust region in its advantage's direction:
    A > 0 and pi - mu > tv_delta, or A < 0 and mu - pi > tv_delta (pi, mu: the token's
    probabilities). Kept tokens get -sg(rho) * A * log pi, whose gradient is that of PPO's
    unclipped surrogate rho * A. `level` maps the log-ratio for the ratio mask and the weight;
    the TV test is per token.
    """
    del prox, on
    log_ratio = logp - behaviour
    rho = jax.lax.stop_gradient(jnp.exp(level(log_ratio)))
    gap = jax.lax.stop_gradient(jnp.exp(logp) - jnp.exp(behaviour))  # pi - mu of the token
    out_ratio = (rho < config.mask_low) | (rho > config.mask_high)
    out_tv = ((adv > 0) & (gap > config.tv_delta)) | ((adv < 0) & (-gap > config.tv_delta))
    masked = out_ratio | out_tv
    return jnp.where(masked, 0.0, -rho * adv * logp), masked


def second_moment_mask(log_ratio, on, tau: float):
    """M2PO's mask (Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL
    Reach with Stale Data on LLMs?", arXiv 2510.01161): drop the tokens with the largest squared
    log-ratio until the second moment M2 = mean((log rho)^2) over the kept loss tokens (`on`) is
    at most `tau`. Returns bool masked (True: dropped; tokens off `on` are never counted as kept).

    The kept set is the k smallest (log rho)^2 for the largest k whose mean is <= tau (prefix
    means of sorted values never decrease, so that is what dropping the largest first leaves);
    ties are broken by position. No gradient flows through the mask.
    """
    sq = jax.lax.stop_gradient(jnp.square(log_ratio)).reshape(-1)
    on_flat = on.reshape(-1)
    key = jnp.where(on_flat, sq, jnp.inf)
    order = jnp.argsort(key, stable=True)
    sorted_sq = key[order]
    counts = jnp.arange(1, sq.shape[0] + 1, dtype=sq.dtype)
    prefix_mean = jnp.cumsum(jnp.where(jnp.isfinite(sorted_sq), sorted_sq, 0.0)) / counts
    valid = jnp.isfinite(sorted_sq) & (prefix_mean <= tau)
    keep_count = jnp.sum(valid)  # valid is a prefix: the means rise along the sorted order
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    kept = on_flat & (rank < keep_count)
    return ~kept.reshape(on.shape)


def m2po(logp, behaviour, adv, config: LossConfig, prox=None, level=_token, on=None):
    """M2PO (Zheng et al. 2025, arXiv 2510.01161): the unclipped surrogate rho * A on the tokens
    that `second_moment_mask` keeps, so the second moment of the log-ratios of what is trained
    stays under `m2_tau` however stale the data; no ratio clipping. The mask is taken over the
    loss tokens (`on`; all tokens when None) of what the function sees: one microbatch, which is
    the paper's minibatch when the minibatch is one microbatch (`learner.token_budget` 0). Under
    a sharded learner (`parallel.mesh` with data x fsdp > 1) it sees one device's rows, so the
    mask is per device's share of the microbatch and the update differs from the single-device
    one (dppo_mask, per token, does not)."""
    del prox
    log_ratio = level(logp - behaviour)
    on = jnp.ones_like(logp, dtype=bool) if on is None else on
    masked = second_moment_mask(log_ratio, on, config.m2_tau)
    return jnp.where(masked, 0.0, -jnp.exp(log_ratio) * adv), masked


LOSSES = {"none": no_correction, "truncated_is": truncated_is, "ppo_clip": ppo_clip,
          "decoupled": decoupled, "dppo_mask": dppo_mask, "m2po": m2po}


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
