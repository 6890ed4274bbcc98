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

Non-finite updates are skipped inside the program: an update whose minibatch loss (any of its
microbatches) or gradient norm is NaN or infinite leaves the parameters, the optimizer state and
the update count exactly as they were (a `lax.cond` on that finite flag, so nothing of it reaches
the published weights), and is counted in the step's `learner/skipped_nonfinite` metric, which
comes to the host with the others (no extra sync). The learner loop counts it and stops the run
after `learner.max_nonfinite_steps` consecutive steps with a skipped update (`NonFiniteSteps`).
The single-device and the sharded step share this program (`microbatch_program`).

Master weights (`learner.master_dtype`, float32 by default): the state's parameters, the optimizer
state and the gradient accumulator are kept in the master dtype; each microbatch's forward and
backward pass runs on a copy cast to the model's compute dtype (`model.dtype`), and its gradient is
cast back to the master dtype before it is added up, so a bfloat16 model is updated in float32
(an update smaller than half a bfloat16 ulp of a weight is kept, not rounded away). The reference
policy (KL) and the decoupled loss's proximal weights are kept in the compute dtype. Published
weights are the master cast to the compute dtype (`compute_params`).

LoRA (`model.lora`, `TrainStep(lora=spec)`): the state's params are the adapters; the model's
weights are a frozen base handed to every microbatch program as an extra, undonated argument
(`freeze`), and the forward pass applies the adapters on the fly, so the gradient (and the
optimizer state, the accumulator, the norms) covers the adapters alone.

Rematerialisation (`model.remat: block`): each transformer block runs under `jax.checkpoint`, so
only its input is kept for the backward pass (the block is recomputed there); `none` keeps every
intermediate. The same switch for the single-device and the sharded step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from headrace.config import LearnerConfig, OptimizerConfig
from headrace.learner import losses
from headrace.learner.batching import FIELDS, TRAIN_FIELDS, Batch
from headrace.metrics.core import MAX, declare
from headrace.model import logprobs
from headrace.model import params as params_lib
from headrace.model.transformer import LOCAL, Layout, ModelDims, hidden, segment_mask, unembed


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
    finite: Any = None  # bool[]: every loss of the current minibatch so far was finite


class NonFiniteSteps(RuntimeError):
    """Too many consecutive learner steps had a non-finite loss or gradient norm."""


SKIPPED = "learner/skipped_nonfinite"  # updates skipped for a non-finite loss or gradient norm
RATIO_MAX = declare("is/ratio_max", MAX)  # the largest importance ratio: max, not sum or mean


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


def cast_floating(tree: Any, dtype) -> Any:
    """`tree` with its floating-point leaves cast to `dtype` (None: as it is); others unchanged.
    A leaf already of `dtype` is returned as it is (no copy)."""
    if tree is None or dtype is None:
        return tree
    dtype = jnp.dtype(dtype)

    def one(x):
        if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(one, tree)


def compute_params(params: Any, dims: ModelDims) -> Any:
    """The weights the model runs with (and the learner publishes): `params` (the master copy)
    cast to the model's compute dtype `dims.dtype`."""
    return cast_floating(params, dims.dtype)


def init_state(params, optimizer: optax.GradientTransformation, kl_coef: float,
               master_dtype: str | None = "float32") -> TrainState:
    """A fresh state: the parameters cast to `master_dtype` (None: kept as they are), the
    optimizer state initialised on them (so in the same dtype), and the reference policy (with a
    KL term) a copy of `params` in their own (compute) dtype."""
    ref = jax.tree.map(jnp.copy, params) if kl_coef else None
    master = cast_floating(params, master_dtype)
    if master is params:
        master = jax.tree.map(jnp.copy, params) if ref is None else params
    return TrainState(jnp.zeros((), jnp.int32), master, optimizer.init(master), ref)


def _logprobs(graphdef, params, mb, temperature, allowed_v, layout: Layout = LOCAL,
              frozen=None, lora_scale: float = 1.0, logits_mib: int = 0):
    """(log-prob, entropy) [b, t-1] of each next token; `graphdef` (or the model's `ModelDims`)
    says the model, `layout` whether its blocks are rematerialised, `logits_mib` the logits' MiB
    at a time (`headrace.model.logprobs`; with the microbatch's `weight`, chunks without a loss
    token are skipped and their positions' results are 0). With `frozen` (LoRA: the fixed base
    weights) `params` are the adapters, applied on the fly with `lora_scale`."""
    base = params if frozen is None else frozen
    dims = graphdef if isinstance(graphdef, ModelDims) else params_lib.merge(graphdef, base).dims
    x_btd, head, _ = hidden(dims, base, mb["tokens"], mb["positions"],
                            segment_mask(mb["segment_ids"]), layout=layout,
                            adapters=None if frozen is None else params, lora_scale=lora_scale)

    def chunk(x, targets):
        return losses.token_logprobs(unembed(dims, head, x), targets, temperature, allowed_v)

    return logprobs.chunked(chunk, x_btd[:, :-1], mb["tokens"][:, 1:],
                            logprobs.chunk_tokens(dims.vocab_size, logits_mib),
                            logprobs.loss_positions(mb))


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
                                     on=weight > 0, **({"level": level} if level else {}))
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
                 allowed_v: np.ndarray | None = None, layout: Layout = LOCAL,
                 lora_scale: float = 1.0) -> Callable:
    """loss(params, microbatch, prox_logp, ref_params, frozen=None) -> (scalar, sums) for one
    microbatch (with `frozen`, LoRA: `params` and `ref_params` are adapters over that base).

    `allowed_v` is the sampler's action constraint (bool[vocab]) when decoding is constrained: the
    learner evaluates the same restricted distribution the actors sampled from.
    """

    def loss_fn(params, mb, prox_logp, ref_params, frozen=None):
        lp = functools.partial(_logprobs, graphdef, mb=mb, temperature=temperature,
                               allowed_v=allowed_v, layout=layout, frozen=frozen,
                               lora_scale=lora_scale, logits_mib=config.logits_mib)
        logp, entropy = lp(params)
        ref_logp = None
        if ref_params is not None:
            ref_logp = lp(ref_params)[0]
        return loss_terms(logp, entropy, mb, config, prox_logp, ref_logp)

    return loss_fn


SUM_KEYS = ("loss/pg", "loss/entropy", "is/clipped_frac", "loss/total", "is/n", "is/rho",
            "is/rho2", "is/ratio_max", "learner/grad_norm", "learner/update_norm", SKIPPED)


def zero_accum(state: TrainState, decoupled: bool, compute_dtype=None) -> Accum:
    """The accumulator between steps: zero gradients (in the master dtype) and sums (and the
    anchor, for `decoupled`, in `compute_dtype`: None, the master's)."""
    keys = SUM_KEYS + (("loss/kl",) if state.ref_params is not None else ())
    anchor = cast_floating(jax.tree.map(jnp.zeros_like, state.params), compute_dtype)
    return Accum(jax.tree.map(jnp.zeros_like, state.params),
                 {k: jnp.zeros((), jnp.float32) for k in keys},
                 anchor if decoupled else None,
                 jnp.ones((), jnp.bool_))


def finish_sums(sums: dict[str, jax.Array], per_update: jax.Array) -> dict[str, jax.Array]:
    """Step metrics from the sums: loss parts and norms averaged over updates, IS over tokens."""
    out = {k: v * per_update for k, v in sums.items() if not k.startswith("is/") and k != SKIPPED}
    out[SKIPPED] = sums[SKIPPED]  # a count over the step, not a mean
    n = jnp.maximum(sums["is/n"], 1.0)
    out["is/clipped_frac"] = sums["is/clipped_frac"] * per_update
    out["is/ratio_mean"] = sums["is/rho"] / n
    out["is/ratio_max"] = sums["is/ratio_max"]
    out["is/ess"] = jnp.square(sums["is/rho"]) / (n * jnp.maximum(sums["is/rho2"], 1e-30))
    return out


def microbatch_program(grads_and_sums: Callable, optimizer: optax.GradientTransformation,
                       decoupled: bool, compute_dtype=None) -> Callable:
    """The program of one microbatch, around `grads_and_sums(params, mb, anchor, ref_params
    [, frozen]) -> (grads, sums)` (`frozen`: LoRA's fixed base, an argument of the program that
    is never donated nor updated): accumulate the gradient and the sums; on a minibatch's last
    microbatch apply one optimizer update and clear the accumulator (a `lax.cond`, so no extra
    compilation); an update whose minibatch loss or gradient norm is not finite is skipped (see
    the module docstring). The same for every way of computing the gradient (one device, or a mesh).

    `grads_and_sums` sees the parameters cast to `compute_dtype` (None: the master's own); its
    gradient is cast back to the master dtype before it is accumulated."""

    def program(carry: tuple[TrainState, Accum], mb: dict[str, jax.Array], first: jax.Array,
                last: jax.Array, per_update: jax.Array, *frozen):
        state, acc = carry
        # A step's first microbatch starts from zeroed sums (grads are zeroed by each update).
        sums = jax.tree.map(lambda s: jnp.where(first, jnp.zeros_like(s), s), acc.sums)
        anchor = None
        if decoupled:  # proximal policy: the weights at the start of this step
            anchor = jax.lax.cond(first, lambda: cast_floating(state.params, compute_dtype),
                                  lambda: acc.anchor)
        grads, new = grads_and_sums(cast_floating(state.params, compute_dtype), mb, anchor,
                                    state.ref_params, *frozen)
        grads = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc.grads, grads)
        sums = {k: (jnp.maximum if k == RATIO_MAX else jnp.add)(v, new[k])
                if k in new else v for k, v in sums.items()}
        # A minibatch's first microbatch follows an update (or starts the step): flag reset.
        finite = jnp.where(first, True, acc.finite) & jnp.isfinite(new["loss/total"])

        def update(_):  # on the global (possibly sharded) arrays: norms and clipping are global
            grad_norm = optax.tree.norm(grads)

            def apply(_):
                updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
                params = optax.apply_updates(state.params, updates)
                return (TrainState(state.step + 1, params, opt_state, state.ref_params),
                        optax.tree.norm(updates))

            def skip(_):  # parameters, optimizer state and update count exactly as they were
                return state, jnp.zeros((), jnp.float32)

            ok = finite & jnp.isfinite(grad_norm)
            new_state, update_norm = jax.lax.cond(ok, apply, skip, None)
            return (new_state, jax.tree.map(jnp.zeros_like, grads),
                    (grad_norm, update_norm, 1.0 - ok.astype(jnp.float32)))

        def keep(_):
            zero = jnp.zeros((), jnp.float32)
            return state, grads, (zero, zero, zero)

        state, grads, (grad_norm, update_norm, skipped) = jax.lax.cond(last, update, keep, None)
        sums["learner/grad_norm"] = sums["learner/grad_norm"] + grad_norm
        sums["learner/update_norm"] = sums["learner/update_norm"] + update_norm
        sums[SKIPPED] = sums[SKIPPED] + skipped
        metrics = finish_sums(sums, per_update)
        metrics["learner/param_norm"] = optax.tree.norm(state.params)
        return (state, Accum(grads, sums, anchor, jnp.where(last, True, finite))), metrics

    return program


class TrainStep:
    """Runs a learner step microbatch by microbatch; `(state, batch) -> (state, metrics)`.

    Donates `state` (its buffers are reused). Each microbatch call is dispatched without waiting
    (no host sync here); the returned metrics are device arrays, ready once the step has run.
    Not thread-safe: one step at a time. Subclasses change where the arrays live (`_placed`,
    `_put`) and how the program is built (`_compile`); `learner.sharded_step.ShardedTrainStep` is one.
    """

    name = "train_step"  # the jitted program's name (`compiles("train_step")` counts it)

    def __init__(self, graphdef, config: LearnerConfig, temperature: float,
                 optimizer: optax.GradientTransformation, allowed_v: np.ndarray | None = None,
                 *, remat: bool = False, dims: ModelDims | None = None, lora=None):
        self.graphdef = graphdef
        self.lora = lora  # `model.lora.LoraSpec`: the state's params are adapters over `frozen`
        self.frozen = None  # LoRA: the fixed base weights in the compute dtype (`freeze`)
        self.remat = remat  # `model.remat: block`: each block under jax.checkpoint
        self.dims = dims  # default: read from the model on the first call
        self.config = config
        self.temperature = temperature
        self.optimizer = optimizer
        self.allowed_v = allowed_v
        self.decoupled = config.loss.kind == "decoupled"
        self._step = None
        self._acc: Accum | None = None
        self._returned: TrainState | None = None  # the state this step last handed out

    def freeze(self, base) -> None:
        """LoRA: `base` (the model's weights, compute dtype, on device) is the fixed model the
        state's adapters apply to; it is an argument of every step, never updated."""
        self.frozen = base

    def grads_and_sums(self, params, mb, anchor, ref_params, frozen=None):
        """(gradient, sums) of one microbatch on one device (with `frozen`: the gradient of the
        adapters `params` only; none is formed for the base)."""
        layout = Layout(remat=self.remat)
        scale = self.lora.scale if self.lora is not None else 1.0
        loss_fn = make_loss_fn(self.dims, self.config, self.temperature, self.allowed_v, layout,
                               scale)
        prox = None
        if anchor is not None:
            prox = jax.lax.stop_gradient(
                _logprobs(self.dims, anchor, mb, self.temperature, self.allowed_v, layout,
                          frozen, scale)[0])
        return jax.grad(loss_fn, has_aux=True)(params, mb, prox, ref_params, frozen)

    def _extra(self) -> tuple:
        """The program's arguments after the microbatch's: the frozen base under LoRA."""
        return () if self.lora is None else (self.frozen,)

    def _program(self) -> Callable:
        program = microbatch_program(self.grads_and_sums, self.optimizer, self.decoupled,
                                     self.dims.dtype)
        program.__name__ = program.__qualname__ = self.name
        return program

    def _compile(self, carry) -> Callable:
        return jax.jit(self._program(), donate_argnums=0)

    def _placed(self, state: TrainState) -> TrainState:
        """The state as the program takes it: every array committed to the device of the
        params (which copies nothing). The state the program returns is committed; one that
        mixes committed arrays (a checkpoint's weights) with uncommitted ones (fresh scalars)
        lowers to another program, so the next call would compile the step a second time."""
        if state is self._returned:
            return state
        return jax.device_put(state, _device_of(state.params))

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
        self._prepare(state)
        epochs = self.config.epochs  # the same device arrays, pass after pass
        per_update = np.float32(1.0 / max(batch.updates * epochs, 1))
        carry, metrics, extra = (state, self._acc), {}, self._extra()  # after `_prepare`
        for epoch in range(epochs):
            for i, (mb, mb_arrays) in enumerate(zip(batch.microbatches, arrays)):
                first = np.bool_(epoch == 0 and i == 0)
                carry, metrics = self._step(carry, mb_arrays, first, np.bool_(mb.last),
                                            per_update, *extra)
                if sync:
                    jax.block_until_ready(carry)  # deliberate sync (measurement only)
        state, self._acc = carry
        self._returned = state
        return state, metrics

    def _placed_accum(self, acc: Accum) -> Accum:
        return jax.device_put(acc, _device_of(acc.grads))  # committed, as `_placed` says

    def _prepare(self, state: TrainState) -> None:
        """The model's sizes, the accumulator and the program, on the first call."""
        if self.lora is not None and self.frozen is None:
            raise RuntimeError("a LoRA TrainStep needs its base: call freeze(base) first")
        if self.dims is None:
            model = self.frozen if self.lora is not None else state.params
            self.dims = params_lib.merge(self.graphdef, model).dims
        if self._acc is None:
            self._acc = self._placed_accum(zero_accum(state, self.decoupled, self.dims.dtype))
        if self._step is None:
            self._step = self._compile((state, self._acc))

    def compiled(self, state: TrainState, arrays: dict[str, Any]):
        """The compiled microbatch program for `state` and one microbatch's arrays (inspection:
        `memory_analysis()`); compiles it when this shape is new, runs nothing."""
        state = self._placed(state)
        self._prepare(state)
        arrays = self._put({k: arrays[k] for k in TRAIN_FIELDS})
        flag = np.bool_(True)
        return self._step.lower((state, self._acc), arrays, flag, flag, np.float32(1),
                                *self._extra()).compile()

    def precompile(self, state: TrainState, shapes: Iterable[tuple[int, int]]) -> None:
        """Compiles the microbatch program for each (rows, width) of `shapes` before any batch
        (`learner.precompile`): a step whose microbatches have those shapes then compiles nothing
        (JAX finds the program in its in-memory cache). Runs nothing; donates nothing."""
        for rows, width in shapes:
            self.compiled(state, {k: np.zeros((rows, width), FIELDS[k]) for k in TRAIN_FIELDS})


def _device_of(tree) -> jax.Device:
    """The device `tree`'s first array lives on (the default device for an uncommitted one, or
    for host arrays)."""
    leaf = jax.tree.leaves(tree)[0]
    return next(iter(leaf.devices())) if isinstance(leaf, jax.Array) else jax.devices()[0]


def make_train_step(graphdef, config: LearnerConfig, temperature: float,
                    optimizer: optax.GradientTransformation,
                    allowed_v: np.ndarray | None = None, *, remat: bool = False,
                    lora=None) -> TrainStep:
    """The learner step (see `TrainStep`); its jitted program is named `train_step`. With `lora`
    (a `headrace.model.lora.LoraSpec`) the state's params are adapters: call `freeze(base)`."""
    return TrainStep(graphdef, config, temperature, optimizer, allowed_v, remat=remat, lora=lora)
