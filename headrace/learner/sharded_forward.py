"""The transformer inside `jax.shard_map`: `ShardedLayout`, the layout `model.transformer.forward`
runs under on one device's blocks, with explicit collectives (the model itself is written once, in
`headrace.model.transformer`; this module says only where its parameters and partial sums live).

- Parameters arrive in their stored layout (`rules.py`: split over `fsdp` and `tensor`).
  `relayout` turns one into its compute layout just before use: an `all_gather` over every axis
  the compute layout does not keep (ZeRO-3; in the backward pass its transpose is the
  reduce-scatter `psum_scatter` of the gradient), and, where the compute layout wants `tensor`
  on a dimension stored whole, a local slice (its gradient is summed over `tensor`).
- With `remat` (`model.remat: block`, the default) each block runs under `jax.checkpoint`, so its
  gathered parameters are not kept for the backward pass: they are gathered again there, one
  layer at a time. Without it every layer's gathered parameters live until its backward pass.
- Tensor parallelism (Megatron, Shoeybi et al. 2019): q/k/v (and their biases) and gate/up are
  column-parallel (heads, hidden units over `tensor`), o and down row-parallel, followed by a
  `psum` over `tensor`. Activations between blocks are replicated over `tensor`; norms (also the
  sandwich norms after o and down, and the per-head q/k norms) act on whole or per-head values.
- The vocabulary is split over `tensor` for the embedding (each device looks up the tokens in
  its rows, then a `psum`) and the logits (a tied model's logits use the same embedding block);
  the log-softmax, the target's log-prob and the entropy take a `pmax` and `psum`s over `tensor`
  (`vocab_logprobs`).

`ShardedLayout` says which of these run split. A part whose size `tensor` does not divide (heads,
kv heads, hidden width, vocabulary) runs whole on every tensor device instead: slower, same result.

Letters in names as in transformer.py (b batch rows of this device, t positions, d model width,
h/g local query/kv heads, r query heads per kv head, e head size, f hidden, v local vocabulary).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from headrace.learner import losses
from headrace.model import logprobs
from headrace.model.distribution import policy_logits
from headrace.model.transformer import Layout, ModelDims, forward, hidden, segment_mask, unembed
from headrace.parallel.mesh import TENSOR


@dataclasses.dataclass(frozen=True)
class ShardedLayout(Layout):
    """Which parts of the model run split over `tensor` (all True when tensor = 1), and where
    each parameter is stored (`stored`: {param path: PartitionSpec}, from `rules.plan_params`).
    """

    tensor: int  # size of the tensor axis
    vocab: bool  # embedding rows and logits by vocabulary
    heads: bool  # q and o by query heads
    kv_heads: bool  # k and v by kv heads (else each device computes all and picks its own)
    mlp: bool  # gate/up/down by hidden unit
    stored: tuple[tuple[str, PartitionSpec], ...] = dataclasses.field(default=(), compare=False)

    @classmethod
    def for_model(cls, dims: ModelDims, tensor: int,
                  stored: dict[str, PartitionSpec] | None = None,
                  remat: bool = True) -> ShardedLayout:
        heads = dims.n_heads % tensor == 0
        return cls(tensor, vocab=dims.vocab_size % tensor == 0, heads=heads,
                   kv_heads=heads and dims.n_kv_heads % tensor == 0,
                   mlp=dims.d_ff % tensor == 0, stored=tuple((stored or {}).items()), remat=remat)

    def compute_spec(self, path: str, ndim: int) -> tuple[str | None, ...]:
        """The layout a parameter is used in: `tensor` on its split dimension, if any."""
        t = TENSOR
        if re.search(r"(^|\.)embed\.embedding$", path):
            return (t if self.vocab else None, None)
        if re.search(r"(^|\.)unembed\.kernel$", path):
            return (None, t if self.vocab else None)
        if re.search(r"\.attn\.q\.kernel$", path):
            return (None, t if self.heads else None)
        if re.search(r"\.attn\.[kv]\.kernel$", path):
            return (None, t if self.kv_heads else None)
        if re.search(r"\.attn\.q\.bias$", path):
            return (t if self.heads else None,)
        if re.search(r"\.attn\.[kv]\.bias$", path):
            return (t if self.kv_heads else None,)
        if re.search(r"\.attn\.o\.kernel$", path):
            return (t if self.heads else None, None)
        if re.search(r"\.mlp\.(gate|up)\.kernel$", path):
            return (None, t if self.mlp else None)
        if re.search(r"\.mlp\.down\.kernel$", path):
            return (t if self.mlp else None, None)
        return (None,) * ndim

    # --- the hooks `transformer.forward` calls ---------------------------------------------------

    @functools.cached_property
    def _stored(self) -> dict[str, PartitionSpec]:
        return dict(self.stored)

    def param(self, path: str, x: jax.Array) -> jax.Array:
        return relayout(x, self._stored[path], self.compute_spec(path, x.ndim))

    def embed(self, table_vd, tokens_bt, dtype):
        if not self.vocab:
            return jnp.take(jnp.asarray(table_vd, dtype), tokens_bt, axis=0)
        rows = table_vd.shape[0]
        local_bt = tokens_bt - jax.lax.axis_index(TENSOR) * rows
        mine_bt = (local_bt >= 0) & (local_bt < rows)
        x_btd = jnp.take(jnp.asarray(table_vd, dtype), jnp.clip(local_bt, 0, rows - 1), axis=0)
        return jax.lax.psum(jnp.where(mine_bt[..., None], x_btd, 0), TENSOR)

    def row_sum(self, partial_btd, part: str):
        """The row-parallel matmul's partial sums, added up over `tensor` (also when its size is 1:
        the psum then marks the result as the same on every tensor device)."""
        split = self.heads if part == "heads" else self.mlp
        return jax.lax.psum(partial_btd, TENSOR) if split else partial_btd

    def local_kv(self, k_bsge, v_bsge, heads: int):
        if not (self.heads and not self.kv_heads):
            return k_bsge, v_bsge
        # All kv heads were computed here: give each local query head its own kv head.
        r = heads * self.tensor // k_bsge.shape[2]  # query heads per kv head
        first = jax.lax.axis_index(TENSOR) * heads
        k_bsge = jax.lax.dynamic_slice_in_dim(jnp.repeat(k_bsge, r, axis=2), first, heads, 2)
        v_bsge = jax.lax.dynamic_slice_in_dim(jnp.repeat(v_bsge, r, axis=2), first, heads, 2)
        return k_bsge, v_bsge


def _axes(spec: PartitionSpec, dim: int) -> tuple[str, ...]:
    entry = spec[dim] if dim < len(spec) else None
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def relayout(x: jax.Array, stored: PartitionSpec, compute: tuple[str | None, ...]) -> jax.Array:
    """One parameter's local block from its stored layout to its compute layout (see module)."""
    for dim in range(x.ndim):
        have, want = _axes(stored, dim), _axes(PartitionSpec(*compute), dim)
        if have == want:
            continue
        for axis in reversed(have):  # minor axis first, so the blocks land in order
            # fsdp/data: ZeRO-3 gather, the gradient comes back through psum_scatter. tensor:
            # the part then runs whole on every tensor device, so the copy is invariant there.
            x = jax.lax.all_gather(x, axis, axis=dim, tiled=True,
                                   to="invarying" if axis == TENSOR else "varying")
        if want:
            (axis,) = want
            size = x.shape[dim] // jax.lax.axis_size(axis)
            x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * size, size, dim)
    return x


class ShardedForward:
    """`logprobs(params, mb)` for one device's rows, params in their stored layout.

    Args:
      dims: the model's sizes.
      layout: what runs split over `tensor`, and where parameters are stored.
    """

    def __init__(self, dims: ModelDims, layout: ShardedLayout, logits_mib: int = 0):
        self.dims = dims
        self.layout = layout
        self.chunk = logprobs.chunk_tokens(dims.vocab_size, logits_mib)

    def logits(self, params, tokens_bt, positions_bt, segment_ids_bt) -> jax.Array:
        """float32 logits [b, t, v]: this device's vocabulary block when it is split."""
        logits_btv, _ = forward(self.dims, params, tokens_bt, positions_bt,
                                segment_mask(segment_ids_bt), layout=self.layout)
        return logits_btv

    def logprobs(self, params, mb: dict[str, jax.Array], temperature: float,
                 allowed_v: jax.Array | None):
        """(log-prob of each next token, entropy), both [b, t-1], as `losses.token_logprobs` of
        the full model: identical on every tensor device. The logits are computed `logits_mib`
        at a time (`headrace.model.logprobs`)."""
        x_btd, head, _ = hidden(self.dims, params, mb["tokens"], mb["positions"],
                                segment_mask(mb["segment_ids"]), layout=self.layout)
        of = losses.token_logprobs if not self.layout.vocab else vocab_logprobs

        def chunk(x, targets):
            return of(unembed(self.dims, head, x), targets, temperature, allowed_v)

        # Chunks without a loss token are skipped, except where the chunk's function holds
        # collectives over `tensor` (a vocabulary split), kept out of a conditional.
        on = None if self.layout.vocab else logprobs.loss_positions(mb)
        return logprobs.chunked(chunk, x_btd[:, :-1], mb["tokens"][:, 1:], self.chunk, on)


def vocab_logprobs(logits_btv, targets_bt, temperature: float, allowed_v):
    """`losses.token_logprobs` over a vocabulary split over `tensor` (this device: block v).

    The max for stability is taken across `tensor` (pmax, no gradient: the log-softmax does not
    depend on it), the normaliser and the entropy are psums, and the target's log-prob comes from
    the device holding it (a psum of a one-hot selection).
    """
    v = logits_btv.shape[-1]
    start = jax.lax.axis_index(TENSOR) * v
    if allowed_v is not None:
        allowed_v = jax.lax.dynamic_slice_in_dim(jnp.asarray(allowed_v), start, v)
    z_btv = policy_logits(logits_btv, temperature, allowed_v)
    top_bt = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(z_btv, axis=-1)), TENSOR)
    shifted_btv = z_btv - top_bt[..., None]
    norm_bt = jnp.log(jax.lax.psum(jnp.sum(jnp.exp(shifted_btv), axis=-1), TENSOR))
    logp_btv = shifted_btv - norm_bt[..., None]
    local_bt = targets_bt - start
    mine_bt = (local_bt >= 0) & (local_bt < v)
    picked_bt = jnp.take_along_axis(logp_btv, jnp.clip(local_bt, 0, v - 1)[..., None], -1)[..., 0]
    logp_bt = jax.lax.psum(jnp.where(mine_bt, picked_bt, 0.0), TENSOR)
    entropy_bt = -jax.lax.psum(jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1), TENSOR)
    return logp_bt, entropy_bt
