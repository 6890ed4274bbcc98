"""Losses and advantages against plain Python references; on-policy gradients agree."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from headrace.config import LossConfig
from headrace.learner import losses
from headrace.learner.advantages import group_advantages

CFG = LossConfig(kind="ppo_clip", rho_max=2.0, clip_eps=0.2, dual_clip=3.0)


def reference_loss(kind, logp, behaviour, adv, prox):
    out = []
    for lp, b, a, px in zip(logp, behaviour, adv, prox):
        rho = math.exp(lp - b)
        if kind == "none":
            out.append(-a * lp)
        elif kind == "truncated_is":
            out.append(-min(rho, CFG.rho_max) * a * lp)
        else:
            ratio = rho if kind == "ppo_clip" else math.exp(lp - px)
            clipped = min(max(ratio, 1 - CFG.clip_eps), 1 + CFG.clip_eps)
            surrogate = min(ratio * a, clipped * a)
            if a < 0:
                surrogate = max(surrogate, CFG.dual_clip * a)
            weight = 1.0 if kind == "ppo_clip" else min(math.exp(px - b), CFG.rho_max)
            out.append(-weight * surrogate)
    return np.array(out)


@pytest.mark.parametrize("kind", ["none", "truncated_is", "ppo_clip", "decoupled"])
def test_loss_matches_python_reference(kind):
    rng = np.random.default_rng(0)
    n = 64
    logp = -rng.uniform(0.1, 3.0, n).astype(np.float32)
    behaviour = (logp + rng.normal(0, 0.7, n)).astype(np.float32)
    prox = (logp + rng.normal(0, 0.3, n)).astype(np.float32)
    adv = rng.normal(0, 1, n).astype(np.float32)
    got, _ = losses.LOSSES[kind](jnp.asarray(logp), jnp.asarray(behaviour), jnp.asarray(adv), CFG,
                                 prox=jnp.asarray(prox))
    np.testing.assert_allclose(np.asarray(got), reference_loss(kind, logp, behaviour, adv, prox),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["none", "truncated_is", "ppo_clip", "decoupled"])
def test_on_policy_gradient_is_policy_gradient(kind):
    """With behaviour == proximal == current policy, every variant's gradient is -A * grad(logp)."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(16, 8)).astype(np.float32))
    actions = jnp.asarray(rng.integers(0, 8, 16))
    adv = jnp.asarray(rng.normal(size=16).astype(np.float32))

    def logp_of(z):
        return jnp.take_along_axis(jax.nn.log_softmax(z), actions[:, None], 1)[:, 0]

    behaviour = jax.lax.stop_gradient(logp_of(logits))

    def loss(z):
        per_token, _ = losses.LOSSES[kind](logp_of(z), behaviour, adv, CFG, prox=behaviour)
        return per_token.mean()

    def reinforce(z):
        return (-adv * logp_of(z)).mean()

    np.testing.assert_allclose(jax.grad(loss)(logits), jax.grad(reinforce)(logits), atol=1e-6)
    if kind in ("ppo_clip", "decoupled"):  # same ratio form: values agree too (ratio = 1)
        np.testing.assert_allclose(loss(logits), (-adv).mean(), atol=1e-6)


def test_importance_stats():
    logp = jnp.log(jnp.array([0.5, 0.5, 0.2, 0.9]))
    behaviour = jnp.log(jnp.array([0.5, 0.25, 0.4, 0.9]))
    weight = jnp.array([1.0, 1.0, 1.0, 0.0])  # last token is not a loss token
    stats = losses.importance_stats(logp, behaviour, weight)
    rho = np.array([1.0, 2.0, 0.5])
    assert float(stats["is/ratio_mean"]) == pytest.approx(rho.mean(), rel=1e-5)
    assert float(stats["is/ratio_max"]) == pytest.approx(2.0, rel=1e-5)
    assert float(stats["is/ess"]) == pytest.approx(rho.sum() ** 2 / (3 * (rho**2).sum()), rel=1e-5)


def reference_advantages(rewards, kind, std_norm):
    g = len(rewards)
    mean = sum(rewards) / g
    out = []
    for r in rewards:
        if kind == "grpo":
            a = r - mean
        else:
            a = r - (sum(rewards) - r) / (g - 1)
        out.append(a)
    if std_norm:
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / g)
        out = [a / (std + 1e-6) for a in out]
    return out


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
@pytest.mark.parametrize("std_norm", [False, True])
def test_group_advantages_match_reference(kind, std_norm):
    rewards = [1.0, 0.0, 0.97, -0.05, 0.0, 1.0, 0.5, 0.25]
    got = group_advantages(np.array(rewards), np.ones(8, bool), kind, std_norm)
    np.testing.assert_allclose(got, reference_advantages(rewards, kind, std_norm), rtol=1e-5)


def test_invalid_members_are_out_of_the_baseline():
    got = group_advantages(np.array([1.0, 0.0, 5.0]), np.array([True, True, False]), "grpo")
    np.testing.assert_allclose(got, [0.5, -0.5, 0.0])
    assert not group_advantages(np.array([1.0, 0.0]), np.array([True, False]), "grpo").any()
