"""dppo_mask and m2po against float64 NumPy references; their masks do what their papers say.

The references are written independently of the vectorised code: a per-token loop for dppo_mask,
and M2PO's greedy procedure as the paper states it (drop the token with the largest squared
log-ratio while the second moment of the rest exceeds tau) for m2po.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from headrace.config import ConfigError, LearnerConfig, LossConfig
from headrace.learner import losses
from headrace.learner.train_step import loss_terms

DPPO = LossConfig(kind="dppo_mask", mask_low=0.125, mask_high=8.0, tv_delta=0.2)
M2PO = LossConfig(kind="m2po", m2_tau=0.04)


def tokens(seed: int, n: int = 256, spread: float = 0.6):
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.05, 3.0, n)
    behaviour = np.minimum(logp + rng.normal(0, spread, n), -1e-3)
    adv = rng.normal(0, 1, n)
    return logp, behaviour, adv


def reference_dppo(logp, behaviour, adv, cfg: LossConfig):
    out, masked = np.zeros_like(logp), np.zeros(logp.shape, bool)
    for i, (lp, b, a) in enumerate(zip(logp, behaviour, adv)):
        rho = np.exp(lp - b)
        gap = np.exp(lp) - np.exp(b)
        outside = rho < cfg.mask_low or rho > cfg.mask_high
        outside |= (a > 0 and gap > cfg.tv_delta) or (a < 0 and -gap > cfg.tv_delta)
        masked[i] = outside
        out[i] = 0.0 if outside else -rho * a * lp
    return out, masked


def reference_m2_mask(log_ratio, on, tau):
    """The paper's procedure, one token at a time (float64)."""
    kept = [i for i in range(len(log_ratio)) if on[i]]
    while kept and np.mean(np.square(log_ratio[kept])) > tau:
        kept.remove(max(kept, key=lambda i: (log_ratio[i] ** 2, i)))
    masked = np.ones(len(log_ratio), bool)
    masked[kept] = False
    return masked


def f32(*arrays):
    return [jnp.asarray(a, jnp.float32) for a in arrays]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dppo_mask_matches_float64_reference(seed):
    logp, behaviour, adv = tokens(seed, spread=1.5)  # wide enough that both masks trigger
    want, want_masked = reference_dppo(logp, behaviour, adv, DPPO)
    got, masked = losses.dppo_mask(*f32(logp, behaviour, adv), DPPO)
    # a float32 ratio is within a few ulps of the float64 one; only tokens within 1e-5 of a mask
    # boundary could flip, and none of these seeds has one there
    np.testing.assert_array_equal(np.asarray(masked), want_masked)
    assert 0 < want_masked.sum() < len(logp)
    # |loss| = rho |A| |logp| with rho <= 8: float32 rounding of exp and two products, relative
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_dppo_masks_only_in_the_direction_that_leaves_the_region():
    # pi - mu = +0.3 on both tokens: a push up (A > 0) leaves the region, a push down does not
    logp, behaviour = np.log([0.6, 0.6]), np.log([0.3, 0.3])
    _, masked = losses.dppo_mask(*f32(logp, behaviour, [1.0, -1.0]), DPPO)
    assert np.asarray(masked).tolist() == [True, False]


@pytest.mark.parametrize("kind", ["dppo_mask", "m2po"])
def test_on_policy_gradient_is_policy_gradient(kind):
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(16, 8)).astype(np.float32))
    actions = jnp.asarray(rng.integers(0, 8, 16))
    adv = jnp.asarray(rng.normal(size=16).astype(np.float32))
    cfg = DPPO if kind == "dppo_mask" else M2PO

    def logp_of(z):
        return jnp.take_along_axis(jax.nn.log_softmax(z), actions[:, None], 1)[:, 0]

    behaviour = jax.lax.stop_gradient(logp_of(logits))

    def loss(z):
        per_token, masked = losses.LOSSES[kind](logp_of(z), behaviour, adv, cfg)
        return per_token.mean(), masked

    grad, masked = jax.grad(loss, has_aux=True)(logits)
    assert not np.asarray(masked).any()  # on-policy nothing leaves any trust region
    want = jax.grad(lambda z: (-adv * logp_of(z)).mean())(logits)
    np.testing.assert_allclose(grad, want, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_second_moment_mask_matches_the_greedy_procedure(seed):
    logp, behaviour, _ = tokens(seed, spread=0.4)
    rng = np.random.default_rng(100 + seed)
    on = rng.random(len(logp)) < 0.8
    log_ratio = logp - behaviour
    log_ratio[~on] = 50.0  # padding with huge ratios must neither count nor be kept
    want = reference_m2_mask(log_ratio, on, M2PO.m2_tau)
    got = np.asarray(losses.second_moment_mask(*f32(log_ratio), jnp.asarray(on), M2PO.m2_tau))
    np.testing.assert_array_equal(got, want)
    kept = ~got
    assert kept.sum() > 0 and got[on].sum() > 0  # the data were stale enough to mask some
    assert np.mean(np.square(log_ratio[kept])) <= M2PO.m2_tau
    # maximal: the smallest token it dropped would push the moment over tau
    dropped = np.flatnonzero(on & got)
    smallest = dropped[np.argmin(np.square(log_ratio[dropped]))]
    assert np.mean(np.square(log_ratio[np.append(np.flatnonzero(kept), smallest)])) > M2PO.m2_tau


def test_m2po_loss_matches_float64_reference():
    logp, behaviour, adv = tokens(4, spread=0.4)
    on = np.ones(len(logp), bool)
    masked = reference_m2_mask(logp - behaviour, on, M2PO.m2_tau)
    want = np.where(masked, 0.0, -np.exp(logp - behaviour) * adv)
    got, got_masked = losses.m2po(*f32(logp, behaviour, adv), M2PO, on=jnp.asarray(on))
    np.testing.assert_array_equal(np.asarray(got_masked), masked)
    # the kept ratios lie within exp(+-sqrt(n tau)); float32 exp and a product: relative 1e-6
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_m2po_in_the_learner_objective_counts_only_loss_tokens():
    """Through `loss_terms` (what the train step runs): padding tokens (weight 0) with absurd
    ratios change nothing, and the masked share is reported as is/clipped_frac."""
    logp, behaviour, adv = tokens(5, n=96, spread=0.4)
    weight = np.zeros(96)
    weight[:64] = 1 / 64
    behaviour[64:] = logp[64:] - 30.0  # padding: ratios of e^30
    # the loss reads positions 1..L-1 of the microbatch's arrays: prepend one column
    mb = {k: jnp.asarray(np.concatenate([[0.0], v])[None], jnp.float32) for k, v in
          (("behaviour_logprobs", behaviour), ("advantages", adv), ("weight", weight))}
    cfg = LearnerConfig(loss=M2PO)
    total, sums = loss_terms(*f32(logp[None], np.zeros((1, 96))), mb, cfg)
    masked = reference_m2_mask((logp - behaviour)[:64], np.ones(64, bool), M2PO.m2_tau)
    want = np.sum(np.where(masked, 0.0, -np.exp(logp - behaviour)[:64] * adv[:64]) / 64)
    assert float(sums["loss/pg"]) == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert float(sums["is/clipped_frac"]) == pytest.approx(masked.mean(), abs=1e-6)
    assert float(total) == pytest.approx(want, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("key,value", [("mask_low", 1.0), ("mask_high", 1.0), ("tv_delta", 0.0),
                                       ("m2_tau", 0.0)])
def test_bad_values_are_refused_with_the_key(key, value):
    with pytest.raises(ConfigError, match=f"learner.loss.{key}"):
        dataclasses.replace(LossConfig(), **{key: value})
