"""The learner step: (state, batch) -> (state, metrics), one jitted program per microbatch shape.

A batch (`batching.Batch`) is a sequence of fixed-shape microbatches, minibatch by minibatch. The
jitted `train_step` program takes one microbatch: it adds the microbatch's gradient to an
accumulator and, on the last microbatch of a minibatch, applies one optimizer update and clears the
accumulator (a `lax.cond` inside the program, so the update costs no extra compilation). Because
the batcher normalises each token's `weight` over the whole minibatch, the summed gradient is the
minibatch gradient exactly. Programs are compiled once per microbatch shape: a learner compiles at
most as many as its shape policy has shapes (`learner/compiles` counts them). With
`learner.epochs` E > 1 a step runs its microbatches E times over, on the same device arrays: E
optimizer updates per minibatch, so each trajectory is in E updates (PPO's epochs).

Token arrays are aligned with `tokens`: the log-prob of token t comes from the logits at t-1, so
the loss uses positions 1..L-1; the batcher gives the first token of every segment weight 0, so no
token is predicted across a segment boundary. Metrics always include the loss parts, grad norm,
param norm and update norm (means over the step's updates), and importance-sampling statistics
over all of the step's loss tokens.

The decoupled loss evaluates its proximal policy with the weights at the start of the step (kept
in the accumulator while the step's updates run).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from headrace.config import LearnerConfig, OptimizerConfig
from headrace.learner import losses
from headrace.learner.batching import TRAIN_FIELDS, Batch
from headrace.model import params as params_lib
from headrace.model.transformer import segment_mask


class TrainState(NamedTuple):
    step: jax.Array  # optimizer updates so far
    params: Any
    opt_state: Any
    ref_params: Any = None  # reference policy for the KL term (None when kl_coef == 0)


class Accum(NamedTuple):
    """What a step carries between its microbatches (all zero between steps)."""

    grads: Any
    sums: dict[str, jax.Array]  # weighted loss parts and IS sums over the step so far
    anchor: Any = None  # params at the start of the step (decoupled loss only)


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


def _is_sums(logp, behaviour, weight) -> dict[str, jax.Array]:
    """Additive importance-sampling sums over loss tokens (weight > 0); see `_finish`."""
    on = weight > 0
    rho = jnp.where(on, jnp.exp(logp - behaviour), 0.0)
    return {"is/n": jnp.sum(on).astype(jnp.float32), "is/rho": jnp.sum(rho),
            "is/rho2": jnp.sum(rho * rho), "is/ratio_max": jnp.max(rho)}


def loss_terms(logp, entropy, mb, config: LearnerConfig, prox_logp=None, ref_logp=None):
    """(scalar, sums) of one microbatch from its policy log-probs and entropies (positions 1..L-1).

    The one definition of the learner's objective, shared by the single-device and the sharded
    step: the policy loss of `config.loss.kind`, the entropy bonus, the KL to the reference (when
    `ref_logp` is given) and the importance-sampling sums, all weighted by the minibatch-normalised
    `weight`, so the scalar is the microbatch's share of its minibatch loss.
    """
    policy_loss = losses.LOSSES[config.loss.kind]
    behaviour, adv, weight = (mb[k][:, 1:] for k in ("behaviour_logprobs", "advantages", "weight"))
    level = None
    if config.loss.level != "token":  # a ratio over the sequence's loss tokens: all, or so far
        fn = losses.sequence_mean if config.loss.level == "sequence" else losses.sequence_prefix
        level = functools.partial(fn, segment_ids_bt=mb["segment_ids"][:, 1:], on_bt=weight > 0)
    per_token, clipped = policy_loss(logp, behaviour, adv, config.loss, prox=prox_logp,
                                     **({"level": level} if level else {}))
    pg_loss = jnp.sum(per_token * weight)
    entropy_mean = jnp.sum(entropy * weight)
    total = pg_loss - config.entropy_coef * entropy_mean
    sums = {"loss/pg": pg_loss, "loss/entropy": entropy_mean,
            "is/clipped_frac": jnp.sum(clipped * weight)}
    if ref_logp is not None:
        kl = jnp.sum(losses.kl_to_reference(logp, jax.lax.stop_gradient(ref_logp)) * weight)
        total = total + config.kl_coef * kl
        sums["loss/kl"] = kl
    sums["loss/total"] = total
    sums.update(_is_sums(jax.lax.stop_gradient(logp), behaviour, weight))
    return total, sums


def make_loss_fn(graphdef, config: LearnerConfig, temperature: float,
                 allowed_v: np.ndarray | None = None) -> Callable:
    """loss(params, microbatch, prox_logp, ref_params) -> (scalar, sums) for one microbatch.

    `allowed_v` is the sampler's action constraint (bool[vocab]) when decoding is constrained: the
    learner evaluates the same restricted distribution the actors sampled from.
    """

    def loss_fn(params, mb, prox_logp, ref_params):
        logp, entropy = _logprobs(graphdef, params, mb, temperature, allowed_v)
        ref_logp = None
        if ref_params is not None:
            ref_logp = _logprobs(graphdef, ref_params, mb, temperature, allowed_v)[0]
        return loss_terms(logp, entropy, mb, config, prox_logp, ref_logp)

    return loss_fn


SUM_KEYS = ("loss/pg", "loss/entropy", "is/clipped_frac", "loss/total", "is/n", "is/rho",
            "is/rho2", "is/ratio_max", "learner/grad_norm", "learner/update_norm")


def zero_accum(state: TrainState, decoupled: bool) -> Accum:
    """The accumulator between steps: zero gradients and sums (and anchor, for `decoupled`)."""
    keys = SUM_KEYS + (("loss/kl",) if state.ref_params is not None else ())
    return Accum(jax.tree.map(jnp.zeros_like, state.params),
                 {k: jnp.zeros((), jnp.float32) for k in keys},
                 jax.tree.map(jnp.zeros_like, state.params) if decoupled else None)


def finish_sums(sums: dict[str, jax.Array], per_update: jax.Array) -> dict[str, jax.Array]:
    """Step metrics from the sums: loss parts and norms averaged over updates, IS over tokens."""
    out = {k: v * per_update for k, v in sums.items() if not k.startswith("is/")}
    n = jnp.maximum(sums["is/n"], 1.0)
    out["is/clipped_frac"] = sums["is/clipped_frac"] * per_update
    out["is/ratio_mean"] = sums["is/rho"] / n
    out["is/ratio_max"] = sums["is/ratio_max"]
    out["is/ess"] = jnp.square(sums["is/rho"]) / (n * jnp.maximum(sums["is/rho2"], 1e-30))
    return out


def microbatch_program(grads_and_sums: Callable, optimizer: optax.GradientTransformation,
                       decoupled: bool) -> Callable:
    """The program of one microbatch, around `grads_and_sums(params, mb, anchor, ref_params) ->
    (grads, sums)`: accumulate the gradient and the sums; on a minibatch's last microbatch apply one
    optimizer update and clear the accumulator (a `lax.cond`, so no extra compilation). The same
    for every way of computing the gradient (one device, or a mesh)."""

    def program(carry: tuple[TrainState, Accum], mb: dict[str, jax.Array], first: jax.Array,
                last: jax.Array, per_update: jax.Array):
        state, acc = carry
        # A step's first microbatch starts from zeroed sums (grads are zeroed by each update).
        sums = jax.tree.map(lambda s: jnp.where(first, jnp.zeros_like(s), s), acc.sums)
        anchor = None
        if decoupled:  # proximal policy: the weights at the start of this step
            anchor = jax.lax.cond(first, lambda: state.params, lambda: acc.anchor)
        grads, new = grads_and_sums(state.params, mb, anchor, state.ref_params)
        grads = jax.tree.map(jnp.add, acc.grads, grads)
        sums = {k: (jnp.maximum if k == "is/ratio_max" else jnp.add)(v, new[k])
                if k in new else v for k, v in sums.items()}

        def update(_):  # on the global (possibly sharded) arrays: norms and clipping are global
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            norms = (optax.tree.norm(grads), optax.tree.norm(updates))
            return (TrainState(state.step + 1, params, opt_state, state.ref_params),
                    jax.tree.map(jnp.zeros_like, grads), norms)

        def keep(_):
            zero = jnp.zeros((), jnp.float32)
            return state, grads, (zero, zero)

        state, grads, (grad_norm, update_norm) = jax.lax.cond(last, update, keep, None)
        sums["learner/grad_norm"] = sums["learner/grad_norm"] + grad_norm
        sums["learner/update_norm"] = sums["learner/update_norm"] + update_norm
        metrics = finish_sums(sums, per_update)
        metrics["learner/param_norm"] = optax.tree.norm(state.params)
        return (state, Accum(grads, sums, anchor)), metrics

    return program


class TrainStep:
    """Runs a learner step microbatch by microbatch; `(state, batch) -> (state, metrics)`.

    Donates `state` (its buffers are reused). Each microbatch call is dispatched without waiting
    (no host sync here); the returned metrics are device arrays, ready once the step has run.
    Not thread-safe: one step at a time. Subclasses change where the arrays live (`_placed`,
    `_put`) and how the program is built (`_compile`); `parallel.step.ShardedTrainStep` is one.
    """

    name = "train_step"  # the jitted program's name (`compiles("train_step")` counts it)

    def __init__(self, graphdef, config: LearnerConfig, temperature: float,
                 optimizer: optax.GradientTransformation, allowed_v: np.ndarray | None = None):
        self.graphdef = graphdef
        self.config = config
        self.temperature = temperature
        self.optimizer = optimizer
        self.allowed_v = allowed_v
        self.decoupled = config.loss.kind == "decoupled"
        self._step = None
        self._acc: Accum | None = None

    def grads_and_sums(self, params, mb, anchor, ref_params):
        """(gradient, sums) of one microbatch on one device."""
        loss_fn = make_loss_fn(self.graphdef, self.config, self.temperature, self.allowed_v)
        prox = None
        if anchor is not None:
            prox = jax.lax.stop_gradient(
                _logprobs(self.graphdef, anchor, mb, self.temperature, self.allowed_v)[0])
        return jax.grad(loss_fn, has_aux=True)(params, mb, prox, ref_params)

    def _program(self) -> Callable:
        program = microbatch_program(self.grads_and_sums, self.optimizer, self.decoupled)
        program.__name__ = program.__qualname__ = self.name
        return program

    def _compile(self, carry) -> Callable:
        return jax.jit(self._program(), donate_argnums=0)

    def _placed(self, state: TrainState) -> TrainState:
        return state

    def _put(self, arrays: dict[str, Any]) -> dict[str, Any]:
        return arrays

    def __call__(self, state: TrainState, batch: Batch,
                 sync: bool = False) -> tuple[TrainState, dict[str, Any]]:
        """One learner step: `batch.updates` optimizer updates per epoch (`learner.epochs`
        passes over the batch; the decoupled proximal policy is the step's starting weights). An
        empty batch changes nothing.

        Args:
          sync: wait for each microbatch before dispatching the next (benchmarks: the compilation
            of a new shape then never overlaps the previous microbatch's computation).

        Returns:
          (state, metrics): metrics are device scalars (empty for an empty batch).
        """
        if not batch.microbatches:
            return state, {}
        arrays = [self._put({k: mb.arrays[k] for k in TRAIN_FIELDS}) for mb in batch.microbatches]
        state = self._placed(state)
        if self._acc is None:
            self._acc = self._placed_accum(zero_accum(state, self.decoupled))
        if self._step is None:
            self._step = self._compile((state, self._acc))
        epochs = self.config.epochs  # the same device arrays, pass after pass
        per_update = np.float32(1.0 / max(batch.updates * epochs, 1))
        carry, metrics = (state, self._acc), {}
        for epoch in range(epochs):
            for i, (mb, mb_arrays) in enumerate(zip(batch.microbatches, arrays)):
                first = np.bool_(epoch == 0 and i == 0)
                carry, metrics = self._step(carry, mb_arrays, first, np.bool_(mb.last),
                                            per_update)
                if sync:
                    jax.block_until_ready(carry)  # deliberate sync (measurement only)
        state, self._acc = carry
        return state, metrics

    def _placed_accum(self, acc: Accum) -> Accum:
        return acc


def make_train_step(graphdef, config: LearnerConfig, temperature: float,
                    optimizer: optax.GradientTransformation,
                    allowed_v: np.ndarray | None = None) -> TrainStep:
    """The learner step (see `TrainStep`); its jitted program is named `train_step`."""
    return TrainStep(graphdef, config, temperature, optimizer, allowed_v)
