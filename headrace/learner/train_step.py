"""The learner step: a pure function (state, batch) -> (state, metrics), jitted once per shape.

A batch holds M minibatches ([M, R, L] arrays, see `batching.py`); the step scans over them, one
optimizer update each. Token arrays are aligned with `tokens`: the log-prob of token t comes from
the logits at t-1, so the loss uses positions 1..L-1 (the first token of every row is never
generated). Metrics always include the loss parts, grad norm, param norm and update norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from headrace.config import LearnerConfig, OptimizerConfig
from headrace.learner import losses
from headrace.model import params as params_lib
from headrace.model.transformer import segment_mask


class TrainState(NamedTuple):
    step: jax.Array  # optimizer updates so far
    params: Any
    opt_state: Any
    ref_params: Any = None  # reference policy for the KL term (None when kl_coef == 0)


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    if config.schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(0.0, config.lr, max(config.warmup_steps, 1),
                                                config.decay_steps)
    elif config.warmup_steps:
        lr = optax.linear_schedule(0.0, config.lr, config.warmup_steps)
    else:
        lr = config.lr
    chain = [optax.clip_by_global_norm(config.clip_norm)] if config.clip_norm else []
    chain.append(optax.adamw(lr, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay))
    return optax.chain(*chain)


def init_state(params, optimizer: optax.GradientTransformation, kl_coef: float) -> TrainState:
    ref = jax.tree.map(jnp.copy, params) if kl_coef else None
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), ref)


def _logprobs(graphdef, params, mb, temperature, allowed_v):
    model = params_lib.merge(graphdef, params)
    logits_blv, _ = model(mb["tokens"], mb["positions"], segment_mask(mb["segment_ids"]))
    return losses.token_logprobs(logits_blv[:, :-1], mb["tokens"][:, 1:], temperature, allowed_v)


def make_loss_fn(graphdef, config: LearnerConfig, temperature: float,
                 allowed_v: np.ndarray | None = None) -> Callable:
    """loss(params, minibatch, prox_logp, ref_params) -> (scalar, metrics) for one minibatch.

    `allowed_v` is the sampler's action constraint (bool[vocab]) when decoding is constrained: the
    learner evaluates the same restricted distribution the actors sampled from.
    """
    policy_loss = losses.LOSSES[config.loss.kind]

    def loss_fn(params, mb, prox_logp, ref_params):
        logp, entropy = _logprobs(graphdef, params, mb, temperature, allowed_v)
        shifted = {k: mb[k][:, 1:] for k in ("behaviour_logprobs", "advantages", "weight")}
        weight = shifted["weight"]
        per_token, clipped = policy_loss(logp, shifted["behaviour_logprobs"],
                                         shifted["advantages"], config.loss, prox=prox_logp)
        pg_loss = jnp.sum(per_token * weight)
        entropy_mean = jnp.sum(entropy * weight)
        total = pg_loss - config.entropy_coef * entropy_mean
        metrics = {"loss/pg": pg_loss, "loss/entropy": entropy_mean,
                   "is/clipped_frac": jnp.sum(clipped * weight)}
        if ref_params is not None:
            ref_logp, _ = _logprobs(graphdef, ref_params, mb, temperature, allowed_v)
            kl = jnp.sum(losses.kl_to_reference(logp, jax.lax.stop_gradient(ref_logp)) * weight)
            total = total + config.kl_coef * kl
            metrics["loss/kl"] = kl
        metrics.update(losses.importance_stats(logp, shifted["behaviour_logprobs"], weight))
        metrics["loss/total"] = total
        return total, metrics

    return loss_fn


def make_train_step(graphdef, config: LearnerConfig, temperature: float,
                    optimizer: optax.GradientTransformation,
                    allowed_v: np.ndarray | None = None) -> Callable:
    """The jitted step. Donates the old state (its buffers are reused for the new one)."""
    loss_fn = make_loss_fn(graphdef, config, temperature, allowed_v)
    decoupled = config.loss.kind == "decoupled"

    def train_step(state: TrainState, batch: dict[str, jax.Array]):
        if decoupled:  # proximal policy: the weights at the start of this step
            prox_mrl = jax.lax.map(
                lambda mb: _logprobs(graphdef, state.params, mb, temperature, allowed_v)[0], batch)
        else:
            prox_mrl = jnp.zeros(batch["tokens"][:, :, 1:].shape, jnp.float32)

        def update(carry, xs):
            params, opt_state = carry
            mb, prox = xs
            (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, mb, prox if decoupled else None, state.ref_params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            metrics["learner/grad_norm"] = optax.global_norm(grads)
            metrics["learner/update_norm"] = optax.global_norm(updates)
            return (params, opt_state), metrics

        (params, opt_state), metrics = jax.lax.scan(update, (state.params, state.opt_state),
                                                    (batch, prox_mrl))
        ratio_max = jnp.max(metrics.pop("is/ratio_max"))
        metrics = jax.tree.map(jnp.mean, metrics)
        metrics["is/ratio_max"] = ratio_max
        metrics["learner/param_norm"] = optax.global_norm(params)
        steps = state.step + batch["tokens"].shape[0]
        return TrainState(steps, params, opt_state, state.ref_params), metrics

    return jax.jit(train_step, donate_argnums=0)
