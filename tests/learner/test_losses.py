"""Losses and advantages against plain Python references; on-policy gradients agree."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from headrace.config import LossConfig
from headrace.learner import losses
from headrace.learner.advantages import group_advantages

CFG = LossConfig(kind="ppo_clip", rho_max=2.0, clip_eps=0.2, dual_clip=3.0)
CLIP_HIGHER = dataclasses.replace(CFG, clip_eps_high=0.28)  # DAPO's asymmetric clip


def reference_loss(kind, logp, behaviour, adv, prox, cfg=CFG):
    high = cfg.clip_eps_high or cfg.clip_eps
    out = []
    for lp, b, a, px in zip(logp, behaviour, adv, prox):
        rho = math.exp(lp - b)
        if kind == "none":
            out.append(-a * lp)
        elif kind == "truncated_is":
            out.append(-min(rho, cfg.rho_max) * a * lp)
        else:
            ratio = rho if kind == "ppo_clip" else math.exp(lp - px)
            clipped = min(max(ratio, 1 - cfg.clip_eps), 1 + high)
            surrogate = min(ratio * a, clipped * a)
            if a < 0:
                surrogate = max(surrogate, cfg.dual_clip * a)
            weight = 1.0 if kind == "ppo_clip" else min(math.exp(px - b), cfg.rho_max)
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


@pytest.mark.parametrize("kind", ["ppo_clip", "decoupled"])
def test_clip_higher_matches_python_reference(kind):
    """`clip_eps_high` widens the clip's upper side only: ratios in (1.2, 1.28] with A > 0 keep
    their gradient, where the symmetric clip stops it."""
    rng = np.random.default_rng(2)
    n = 256
    logp = -rng.uniform(0.1, 3.0, n).astype(np.float32)
    behaviour = (logp - rng.uniform(-0.4, 0.4, n)).astype(np.float32)
    prox = (logp - rng.uniform(-0.4, 0.4, n)).astype(np.float32)
    adv = rng.normal(0, 1, n).astype(np.float32)
    args = [jnp.asarray(x) for x in (logp, behaviour, adv)]
    got, clipped = losses.LOSSES[kind](*args, CLIP_HIGHER, prox=jnp.asarray(prox))
    want = reference_loss(kind, logp, behaviour, adv, prox, CLIP_HIGHER)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    symmetric = reference_loss(kind, logp, behaviour, adv, prox)
    ratio = np.exp(logp - (behaviour if kind == "ppo_clip" else prox))
    between = (ratio > 1.2) & (ratio < 1.28) & (adv > 0)
    assert between.sum() >= 10  # the data reach the band where the two clips differ
    assert not np.asarray(clipped)[between].any()
    assert not np.allclose(want[between], symmetric[between])
    _, clipped_symmetric = losses.LOSSES[kind](*args, CFG, prox=jnp.asarray(prox))
    assert np.asarray(clipped_symmetric)[between].all()


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


def packed(seed: int, rows: int = 4, width: int = 12):
    """A packed microbatch: up to three sequences per row (segment ids 1..), padding 0, a loss
    mask on some tokens; per-token logp/behaviour/prox and one advantage per sequence."""
    rng = np.random.default_rng(seed)
    segments = np.zeros((rows, width), np.int32)
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, width), 3, replace=False))
        for k, (lo, hi) in enumerate(zip([0, *cuts[:-1]], cuts)):
            segments[r, lo:hi] = k + 1
    on = (segments > 0) & (rng.random((rows, width)) < 0.7)
    logp = -rng.uniform(0.1, 3.0, (rows, width)).astype(np.float32)
    behaviour = (logp + rng.normal(0, 0.5, (rows, width))).astype(np.float32)
    prox = (logp + rng.normal(0, 0.2, (rows, width))).astype(np.float32)
    adv = rng.normal(0, 1, (rows, width)).astype(np.float32)
    for r in range(rows):  # the advantage is the sequence's
        for k in range(1, 4):
            adv[r, segments[r] == k] = adv[r, segments[r] == k][:1].sum()
    return segments, on, logp, behaviour, prox, adv


def reference_sequence_loss(kind, segments, on, logp, behaviour, adv, prox, level="sequence"):
    """Per token, with every ratio the geometric mean over its sequence's loss tokens (GSPO), or
    (`level="prefix"`) the product over its sequence's loss tokens up to and including it."""
    out = np.zeros_like(logp)
    for r in range(logp.shape[0]):
        for k in set(segments[r].tolist()) - {0}:
            cols = np.flatnonzero(segments[r] == k)
            mask = on[r, cols]
            for c in cols:
                def seq_log_ratio(x, y, r=r, cols=cols, mask=mask, c=c):
                    if level == "prefix":
                        upto = (mask & (cols < c)) | (cols == c)  # earlier loss tokens, itself
                        return float(np.sum((x - y)[r, cols][upto]))
                    return float(np.mean((x - y)[r, cols][mask])) if mask.any() else 0.0

                lp, a = logp[r, c], adv[r, c]
                if kind == "none":
                    out[r, c] = -a * lp
                elif kind == "truncated_is":
                    out[r, c] = -min(math.exp(seq_log_ratio(logp, behaviour)), CFG.rho_max) * a * lp
                else:
                    ratio = math.exp(seq_log_ratio(logp, behaviour if kind == "ppo_clip" else prox))
                    clipped = min(max(ratio, 1 - CFG.clip_eps), 1 + CFG.clip_eps)
                    surrogate = min(ratio * a, clipped * a)
                    if a < 0:
                        surrogate = max(surrogate, CFG.dual_clip * a)
                    weight = 1.0 if kind == "ppo_clip" else min(
                        math.exp(seq_log_ratio(prox, behaviour)), CFG.rho_max)
                    out[r, c] = -weight * surrogate
    return out


def test_sequence_mean_matches_a_loop():
    segments, on, logp, *_ = packed(3)
    got = np.asarray(losses.sequence_mean(jnp.asarray(logp), jnp.asarray(segments),
                                          jnp.asarray(on)))
    for r in range(logp.shape[0]):
        for c in range(logp.shape[1]):
            same = (segments[r] == segments[r, c]) & on[r]
            want = logp[r][same].mean() if same.any() else 0.0
            assert got[r, c] == pytest.approx(want, rel=1e-5, abs=1e-6)


LEVELS = {"sequence": losses.sequence_mean, "prefix": losses.sequence_prefix}


@pytest.mark.parametrize("level_name", sorted(LEVELS))
@pytest.mark.parametrize("kind", ["none", "truncated_is", "ppo_clip", "decoupled"])
def test_sequence_level_loss_matches_python_reference(kind, level_name):
    segments, on, logp, behaviour, prox, adv = packed(4)
    level = functools.partial(LEVELS[level_name], segment_ids_bt=jnp.asarray(segments),
                              on_bt=jnp.asarray(on))
    got, _ = losses.LOSSES[kind](jnp.asarray(logp), jnp.asarray(behaviour), jnp.asarray(adv), CFG,
                                 prox=jnp.asarray(prox), level=level)
    want = reference_sequence_loss(kind, segments, on, logp, behaviour, adv, prox, level_name)
    np.testing.assert_allclose(np.where(segments > 0, np.asarray(got), 0), np.where(
        segments > 0, want, 0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("level_name", sorted(LEVELS))
@pytest.mark.parametrize("kind", ["truncated_is", "ppo_clip", "decoupled"])
def test_sequence_level_on_policy_gradient_is_the_token_level_one(kind, level_name):
    """On-policy, a sequence's ratio is 1 and its gradient the mean of its tokens' grad logp: with
    token-mean weights (equal per loss token) the gradient is REINFORCE's."""
    segments, on, _, _, _, adv = packed(5)
    rng = np.random.default_rng(6)
    logits = jnp.asarray(rng.normal(size=(*segments.shape, 8)).astype(np.float32))
    actions = jnp.asarray(rng.integers(0, 8, segments.shape))
    weight = jnp.asarray(on / on.sum(), jnp.float32)
    level = functools.partial(LEVELS[level_name], segment_ids_bt=jnp.asarray(segments),
                              on_bt=jnp.asarray(on))

    def logp_of(z):
        return jnp.take_along_axis(jax.nn.log_softmax(z), actions[..., None], -1)[..., 0]

    behaviour = jax.lax.stop_gradient(logp_of(logits))

    def loss(z):
        per_token, _ = losses.LOSSES[kind](logp_of(z), behaviour, jnp.asarray(adv), CFG,
                                           prox=behaviour, level=level)
        return jnp.sum(per_token * weight)

    def reinforce(z):
        return jnp.sum(-jnp.asarray(adv) * logp_of(z) * weight)

    np.testing.assert_allclose(jax.grad(loss)(logits), jax.grad(reinforce)(logits), atol=1e-6)


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
