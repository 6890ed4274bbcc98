"""The transformer's forward pass and token log-probs as one device sees them inside `shard_map`.

Mirrors `headrace.model.transformer` operation for operation (same RoPE, RMSNorm, GQA attention,
SwiGLU, same dtypes), but on local blocks with explicit collectives:

- Parameters arrive in their stored layout (`rules.py`: split over `fsdp` and `tensor`).
  `relayout` turns one into its compute layout just before use: an `all_gather` over every axis
  the compute layout does not keep (ZeRO-3; in the backward pass its transpose is the
  reduce-scatter `psum_scatter` of the gradient), and, where the compute layout wants `tensor`
  on a dimension stored whole, a local slice (its gradient is summed over `tensor`).
- Each block runs under `jax.checkpoint`, so its gathered parameters are not kept for the
  backward pass: they are gathered again there, one layer at a time.
- Tensor parallelism (Megatron, Shoeybi et al. 2019): q/k/v and gate/up are column-parallel
  (heads, hidden units over `tensor`), o and down row-parallel, followed by a `psum` over
  `tensor`. Activations between blocks are replicated over `tensor`.
- The vocabulary is split over `tensor` for the embedding (each device looks up the tokens in
  its rows, then a `psum`) and the logits; the log-softmax, the target's log-prob and the entropy
  take a `pmax` and `psum`s over `tensor` (`vocab_logprobs`).

`Layout` says which of these run split. A part whose size `tensor` does not divide (heads, kv
heads, hidden width, vocabulary) runs whole on every tensor device instead: slower, same result.

Letters in names as in transformer.py (b batch rows of this device, t positions, d model width,
h/g local query/kv heads, r query heads per kv head, e head size, f hidden, v local vocabulary).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from headrace.learner import losses
from headrace.model.distribution import policy_logits
from headrace.model.transformer import ModelDims, attend, rope, segment_mask
from headrace.parallel.mesh import TENSOR

NORM_EPS = 1e-6  # transformer.RMSNorm's default


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which parts of the model run split over `tensor` (all True when tensor = 1)."""

    tensor: int  # size of the tensor axis
    vocab: bool  # embedding rows and logits by vocabulary
    heads: bool  # q and o by query heads
    kv_heads: bool  # k and v by kv heads (else each device computes all and picks its own)
    mlp: bool  # gate/up/down by hidden unit

    @classmethod
    def for_model(cls, dims: ModelDims, tensor: int) -> Layout:
        heads = dims.n_heads % tensor == 0
        return cls(tensor, vocab=dims.vocab_size % tensor == 0, heads=heads,
                   kv_heads=heads and dims.n_kv_heads % tensor == 0,
                   mlp=dims.d_ff % tensor == 0)

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
        if re.search(r"\.attn\.o\.kernel$", path):
            return (t if self.heads else None, None)
        if re.search(r"\.mlp\.(gate|up)\.kernel$", path):
            return (None, t if self.mlp else None)
        if re.search(r"\.mlp\.down\.kernel$", path):
            return (t if self.mlp else None, None)
        return (None,) * ndim


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


def _rms_norm(x_btd, scale_d):
    x32 = x_btd.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + NORM_EPS)
    return (normed * scale_d.astype(jnp.float32)).astype(x_btd.dtype)


def _dense(x, kernel, dtype):
    return jnp.asarray(x, dtype) @ jnp.asarray(kernel, dtype)


class ShardedForward:
    """`logprobs(params, mb)` for one device's rows, params in their stored layout.

    Args:
      dims: the model's sizes.
      layout: what runs split over `tensor`.
      stored: {param path: PartitionSpec} (from `rules.plan_params`).
    """

    def __init__(self, dims: ModelDims, layout: Layout, stored: dict[str, PartitionSpec]):
        self.dims = dims
        self.layout = layout
        self.stored = stored
        self.dtype = jnp.dtype(dims.dtype)

    def _param(self, tree: dict, path: str) -> jax.Array:
        """The parameter at `path` of `tree`, in its compute layout."""
        node: Any = tree
        for key in path.split("."):
            node = node[int(key)] if key.isdigit() and int(key) in node else node[key]
        return relayout(node, self.stored[path], self.layout.compute_spec(path, node.ndim))

    def _attention(self, p, x_btd, positions_bt, mask_bqk):
        d, lay = self.dims, self.layout
        b, t, _ = x_btd.shape
        e, r = d.head_dim, d.n_heads // d.n_kv_heads
        q = _dense(x_btd, p("attn.q.kernel"), self.dtype)
        k = _dense(x_btd, p("attn.k.kernel"), self.dtype)
        v = _dense(x_btd, p("attn.v.kernel"), self.dtype)
        h, g = q.shape[-1] // e, k.shape[-1] // e
        q_bthe = rope(q.reshape(b, t, h, e), positions_bt)
        k_btge = rope(k.reshape(b, t, g, e), positions_bt)
        v_btge = v.reshape(b, t, g, e)
        if lay.heads and not lay.kv_heads:
            # All kv heads were computed here: give each local query head its own kv head.
            first = jax.lax.axis_index(TENSOR) * h
            k_btge = jax.lax.dynamic_slice_in_dim(jnp.repeat(k_btge, r, axis=2), first, h, 2)
            v_btge = jax.lax.dynamic_slice_in_dim(jnp.repeat(v_btge, r, axis=2), first, h, 2)
            g = h
        out_btgre = attend(q_bthe.reshape(b, t, g, h // g, e), k_btge, v_btge, mask_bqk,
                           causal=True)
        out_btd = _dense(out_btgre.reshape(b, t, h * e), p("attn.o.kernel"), self.dtype)
        return self._row_parallel(out_btd, lay.heads)

    def _mlp(self, p, x_btd):
        gate = _dense(x_btd, p("mlp.gate.kernel"), self.dtype)
        up = _dense(x_btd, p("mlp.up.kernel"), self.dtype)
        out_btd = _dense(jax.nn.silu(gate) * up, p("mlp.down.kernel"), self.dtype)
        return self._row_parallel(out_btd, self.layout.mlp)

    def _row_parallel(self, partial_btd, split: bool):
        """The row-parallel matmul's partial sums, added up over `tensor` (also when its size is 1:
        the psum then marks the result as the same on every tensor device)."""
        return jax.lax.psum(partial_btd, TENSOR) if split else partial_btd

    def _block(self, index: int):
        prefix = f"layers.{index}."

        def block(layer, x_btd, positions_bt, mask_bqk):
            def p(name):
                return self._param({"layers": {index: layer}}, prefix + name)

            h_btd = self._attention(p, _rms_norm(x_btd, p("attn_norm.scale")), positions_bt,
                                    mask_bqk)
            x_btd = x_btd + h_btd
            return x_btd + self._mlp(p, _rms_norm(x_btd, p("mlp_norm.scale")))

        # Remat: the block's gathered parameters are not saved for the backward pass.
        return jax.checkpoint(block)

    def _embed(self, params, tokens_bt):
        table_vd = self._param(params, "embed.embedding")
        if not self.layout.vocab:
            return jnp.take(jnp.asarray(table_vd, self.dtype), tokens_bt, axis=0)
        rows = table_vd.shape[0]
        local_bt = tokens_bt - jax.lax.axis_index(TENSOR) * rows
        mine_bt = (local_bt >= 0) & (local_bt < rows)
        x_btd = jnp.take(jnp.asarray(table_vd, self.dtype), jnp.clip(local_bt, 0, rows - 1), axis=0)
        return jax.lax.psum(jnp.where(mine_bt[..., None], x_btd, 0), TENSOR)

    def logits(self, params, tokens_bt, positions_bt, segment_ids_bt) -> jax.Array:
        """float32 logits [b, t, v]: this device's vocabulary block when it is split."""
        mask_bqk = segment_mask(segment_ids_bt)
        x_btd = self._embed(params, tokens_bt)
        for i in range(self.dims.n_layers):
            x_btd = self._block(i)(params["layers"][i], x_btd, positions_bt, mask_bqk)
        x_btd = _rms_norm(x_btd, self._param(params, "final_norm.scale"))
        return _dense(x_btd, self._param(params, "unembed.kernel"), self.dtype).astype(jnp.float32)

    def logprobs(self, params, mb: dict[str, jax.Array], temperature: float,
                 allowed_v: jax.Array | None):
        """(log-prob of each next token, entropy), both [b, t-1], as `losses.token_logprobs` of
        the full model: identical on every tensor device."""
        logits_btv = self.logits(params, mb["tokens"], mb["positions"], mb["segment_ids"])
        targets_bt = mb["tokens"][:, 1:]
        if not self.layout.vocab:
            return losses.token_logprobs(logits_btv[:, :-1], targets_bt, temperature, allowed_v)
        return vocab_logprobs(logits_btv[:, :-1], targets_bt, temperature, allowed_v)


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
