"""A decoder-only transformer, one definition for every family and every device layout.

The math is one function, `forward(dims, params, ...)`, over a plain params tree; every switch
that a family changes comes from `ModelDims` (`dims.py`): RoPE with its base and scaling, RMSNorm
(with Gemma's 1 + w), grouped-query attention with optional q/k/v biases, q/k norms, soft-capping
and sliding-window layers, a SwiGLU or GeGLU feed-forward, optional sandwich norms, tied or untied
embeddings. Where the parameters live is the `layout`'s business: `LOCAL` (one device: every
parameter whole, nothing to add up) or `headrace.learner.sharded_forward.ShardedLayout` (inside
`jax.shard_map`: each parameter gathered to its compute layout just before use, the tensor-parallel
partial sums added with `psum`). So the single-device learner, the sampler and the sharded learner
run the same code. The NNX `Transformer` holds the parameters (initialisation, the graph definition
the rest of the system passes around) and calls `forward`.

Attention takes an explicit boolean mask `mask_bqk` (query row may see key slot), so the caller
decides what is visible: causal within a segment for packed training rows, or "written cache slots
up to the query" while decoding; sliding layers also hide keys `sliding_window` or more positions
back (a key's position is its cache slot with a cache, its `positions_bt` entry without). With a
`cache` (per layer a key and a value array of S slots) the new keys and values are written at
`cache_index`, an int array [b, t] of each token's slot (a slot out of range drops that token's
write), and attention runs over all S slots; without one it runs over the input itself, and the
mask must then be causal (no query sees a later position; `segment_mask` is): long inputs are
attended in tiles of `QUERY_CHUNK` queries, each over the keys up to its last query only (`attend`).
With `last_only` (sampling: only the next token's distribution is needed) the last layer computes
keys and values for every position but queries, feed-forward and logits for the last one alone;
the logits are then `[b, 1, v]` (at a large vocabulary that projection dominates a prefill).

Letters in names: b batch, t/q query positions, k/s key slots, d model width, h query heads,
g kv heads, r query heads per kv head, e head size, f feed-forward width, v vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from headrace.model.dims import FULL, SLIDING, ModelDims, RopeScaling

__all__ = ["FULL", "LOCAL", "SLIDING", "KVCache", "Layout", "ModelDims", "RopeScaling",
           "Transformer", "attend", "build_model", "forward", "rope", "segment_mask"]

KVCache = list[tuple[jax.Array, jax.Array]]  # per layer: k_bsge, v_bsge
# Queries per attention tile over a long causal input. Measured on CPU (fwd + bwd, 4,096 positions,
# 2 heads of 16): one [t, t] score matrix 0.93 s, tiles of 1,024 / 256 / 128 queries 0.53 / 0.25 /
# 0.22 s, compile 0.3 / 2.5 / 5 s: the tiles skip the keys after them (about half the work) and
# keep each tile's scores in cache. 256 balances step time against compile time per shape.
QUERY_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where parameters and partial results live; this base class is one device (`LOCAL`).

    `forward` calls these hooks, and nothing else differs between one device and a mesh:
    `param` turns a stored parameter into the block it is used as, `embed` looks tokens up,
    `row_sum` adds up the partial outputs of a row-parallel matmul (`part`: "heads" or "mlp"),
    `local_kv` gives each local query head group its kv heads, `block` wraps a layer: with
    `remat` (`model.remat: block`) under `jax.checkpoint`, so a backward pass keeps only each
    block's input and recomputes the rest (under a sharded layout also the gathered parameters).
    """

    remat: bool = dataclasses.field(default=False, kw_only=True)

    def param(self, path: str, x: jax.Array) -> jax.Array:
        return x

    def embed(self, table_vd: jax.Array, tokens_bt: jax.Array, dtype) -> jax.Array:
        return jnp.take(jnp.asarray(table_vd, dtype), tokens_bt, axis=0)

    def row_sum(self, partial_btd: jax.Array, part: str) -> jax.Array:
        return partial_btd

    def local_kv(self, k_btge, v_btge, heads: int):
        return k_btge, v_btge

    def block(self, fn):
        return jax.checkpoint(fn) if self.remat else fn


LOCAL = Layout()


def rope(x_bthe: jax.Array, positions_bt: jax.Array, inv_freq_e) -> jax.Array:
    """Rotary position embedding (Su et al. 2021, RoFormer), rotate-half form, float32 angles."""
    half = x_bthe.shape[-1] // 2
    angle_bte = positions_bt[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_e, jnp.float32)
    sin, cos = jnp.sin(angle_bte)[:, :, None, :], jnp.cos(angle_bte)[:, :, None, :]
    x1, x2 = x_bthe[..., :half].astype(jnp.float32), x_bthe[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bthe.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, dims: ModelDims) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019) over the last axis in float32; Gemma's scale is 1 + w."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + dims.norm_eps)
    scale32 = scale.astype(jnp.float32)
    return (normed * (1.0 + scale32 if dims.norm_offset else scale32)).astype(x.dtype)


def _softcap(x, cap: float):
    return cap * jnp.tanh(x / cap) if cap else x


def _softmax_attention(q_btgre, k_bsge, v_bsge, mask_bqk, scale: float, softcap: float):
    scores_bgrts = jnp.einsum("btgre,bsge->bgrts", q_btgre, k_bsge).astype(jnp.float32)
    scores_bgrts = _softcap(scores_bgrts * scale, softcap)
    scores_bgrts = jnp.where(mask_bqk[:, None, None], scores_bgrts, -1e30)
    probs_bgrts = jax.nn.softmax(scores_bgrts, axis=-1).astype(q_btgre.dtype)
    return jnp.einsum("bgrts,bsge->btgre", probs_bgrts, v_bsge)


def attend(q_btgre, k_bsge, v_bsge, mask_bqk, *, causal: bool, scale: float | None = None,
           softcap: float = 0.0):
    """Grouped-query softmax attention of queries [b, t, g, r, e] over keys and values [b, s, g, e]
    where `mask_bqk` allows (scores times `scale`, default e ** -0.5, then soft-capped when
    `softcap`). With `causal` (queries and keys are the same positions and no query sees a later
    one) a long input goes in tiles of `QUERY_CHUNK` queries, each over the keys up to its last
    query: the keys it skips are masked for it anyway, so the result is the same (padding queries
    that see no key at all are the one exception; nothing reads them). The tiles are unrolled,
    static shapes."""
    scale = q_btgre.shape[-1] ** -0.5 if scale is None else scale
    t = q_btgre.shape[1]
    if not causal or t <= QUERY_CHUNK:
        return _softmax_attention(q_btgre, k_bsge, v_bsge, mask_bqk, scale, softcap)
    tiles = []
    for lo in range(0, t, QUERY_CHUNK):
        hi = min(lo + QUERY_CHUNK, t)
        tiles.append(_softmax_attention(q_btgre[:, lo:hi], k_bsge[:, :hi], v_bsge[:, :hi],
                                        mask_bqk[:, lo:hi, :hi], scale, softcap))
    return jnp.concatenate(tiles, axis=1)


def _dense(x, kernel, dtype, bias=None, lora=None):
    """x @ kernel (+ bias); with `lora` = (A, B, scale), plus scale * (x @ A) @ B (LoRA applied
    on the fly: the learner's gradient then flows to A and B, never to the kernel)."""
    x = jnp.asarray(x, dtype)
    out = x @ jnp.asarray(kernel, dtype)
    if lora is not None:
        a, b, scale = lora
        out = out + ((x @ jnp.asarray(a, dtype)) @ jnp.asarray(b, dtype)) * jnp.asarray(scale,
                                                                                       dtype)
    return out if bias is None else out + jnp.asarray(bias, dtype)


def _attention(dims: ModelDims, layout: Layout, p, lora, index: int, x_btd, positions_bt,
               mask_bqk, cache_kv, cache_index, last_only: bool):
    dtype = jnp.dtype(dims.dtype)
    b, t, _ = x_btd.shape
    e = dims.head_dim
    bias = dims.qkv_bias
    x_bqd = x_btd[:, -1:] if last_only else x_btd  # queries: the last position, or all
    t_q = x_bqd.shape[1]
    q = _dense(x_bqd, p("attn.q.kernel"), dtype, p("attn.q.bias") if bias else None,
               lora("attn.q"))
    k = _dense(x_btd, p("attn.k.kernel"), dtype, p("attn.k.bias") if bias else None,
               lora("attn.k"))
    v = _dense(x_btd, p("attn.v.kernel"), dtype, p("attn.v.bias") if bias else None,
               lora("attn.v"))
    h, g = q.shape[-1] // e, k.shape[-1] // e  # this device's heads
    q_bthe, k_btge, v_btge = q.reshape(b, t_q, h, e), k.reshape(b, t, g, e), v.reshape(b, t, g, e)
    if dims.qk_norm:
        q_bthe = rms_norm(q_bthe, p("attn.q_norm.scale"), dims)
        k_btge = rms_norm(k_btge, p("attn.k_norm.scale"), dims)
    inv_freq_e = dims.inv_freq(dims.layer_type(index))
    q_bthe = rope(q_bthe, positions_bt[:, -t_q:], inv_freq_e)
    k_btge = rope(k_btge, positions_bt, inv_freq_e)
    if cache_kv is not None:  # cache_index_bt: each token's slot
        rows_b1 = jnp.arange(b)[:, None]
        k_bsge = cache_kv[0].at[rows_b1, cache_index].set(k_btge, mode="drop")
        v_bsge = cache_kv[1].at[rows_b1, cache_index].set(v_btge, mode="drop")
        cache_kv = (k_bsge, v_bsge)
    else:
        k_bsge, v_bsge = k_btge, v_btge
    k_bsge, v_bsge = layout.local_kv(k_bsge, v_bsge, h)
    g = k_bsge.shape[2]
    out_btgre = attend(q_bthe.reshape(b, t_q, g, h // g, e), k_bsge, v_bsge, mask_bqk[:, -t_q:],
                       causal=cache_kv is None and not last_only, scale=dims.scale,
                       softcap=dims.attn_softcap)
    out_btd = _dense(out_btgre.reshape(b, t_q, h * e), p("attn.o.kernel"), dtype,
                     lora=lora("attn.o"))
    return layout.row_sum(out_btd, "heads"), cache_kv


def _mlp(dims: ModelDims, layout: Layout, p, lora, x_btd):
    """Gated feed-forward (Shazeer 2020, "GLU Variants Improve Transformer"): SwiGLU or GeGLU."""
    dtype = jnp.dtype(dims.dtype)
    gate = _dense(x_btd, p("mlp.gate.kernel"), dtype, lora=lora("mlp.gate"))
    act = jax.nn.silu(gate) if dims.activation == "silu" else jax.nn.gelu(gate, approximate=True)
    up = _dense(x_btd, p("mlp.up.kernel"), dtype, lora=lora("mlp.up"))
    out_btd = _dense(act * up, p("mlp.down.kernel"), dtype, lora=lora("mlp.down"))
    return layout.row_sum(out_btd, "mlp")


def _block(dims: ModelDims, layout: Layout, index: int, last_only: bool, lora_scale: float):
    prefix = f"layers.{index}."

    def block(layer, x_btd, positions_bt, mask_bqk, cache_kv, cache_index, adapters=None):
        def p(name):
            return layout.param(prefix + name, _lookup(layer, name))

        def lora(path):  # (A, B, scale) of the projection at `path`, or None
            part, proj = path.split(".")
            pair = (adapters or {}).get(part, {}).get(proj)
            return None if pair is None else (pair["lora_a"], pair["lora_b"], lora_scale)

        h_btd, cache_kv = _attention(dims, layout, p, lora, index,
                                     rms_norm(x_btd, p("attn_norm.scale"), dims),
                                     positions_bt, mask_bqk, cache_kv, cache_index, last_only)
        if dims.sandwich_norm:
            h_btd = rms_norm(h_btd, p("attn_post_norm.scale"), dims)
        x_btd = (x_btd[:, -1:] if last_only else x_btd) + h_btd
        h_btd = _mlp(dims, layout, p, lora, rms_norm(x_btd, p("mlp_norm.scale"), dims))
        if dims.sandwich_norm:
            h_btd = rms_norm(h_btd, p("mlp_post_norm.scale"), dims)
        return x_btd + h_btd, cache_kv

    return block


def _lookup(tree: Any, path: str) -> Any:
    node = tree
    for key in path.split("."):
        node = node[int(key)] if key.isdigit() and int(key) in node else node[key]
    return node


def forward(dims: ModelDims, params: Any, tokens_bt, positions_bt, mask_bqk,
            cache: KVCache | None = None, cache_index=None, last_only: bool = False,
            layout: Layout = LOCAL, adapters: Any = None, lora_scale: float = 1.0):
    """The model's float32 logits [b, t, v] ([b, 1, v] with `last_only`; under a sharded layout
    this device's vocabulary block) and the updated cache (None without one): `unembed` of
    `hidden` (the arguments are `hidden`'s)."""
    x_btd, head, new_cache = hidden(dims, params, tokens_bt, positions_bt, mask_bqk, cache,
                                    cache_index, last_only, layout, adapters, lora_scale)
    return unembed(dims, head, x_btd), new_cache


def unembed(dims: ModelDims, head: jax.Array, x_btd: jax.Array) -> jax.Array:
    """float32 logits [..., v] of final hidden states [..., d] through `hidden`'s `head`."""
    dtype = jnp.dtype(dims.dtype)
    if dims.tie_embeddings:
        logits_btv = jnp.einsum("...d,vd->...v", jnp.asarray(x_btd, dtype),
                                jnp.asarray(head, dtype))
    else:
        logits_btv = _dense(x_btd, head, dtype)
    return _softcap(logits_btv.astype(jnp.float32), dims.final_softcap)


def hidden(dims: ModelDims, params: Any, tokens_bt, positions_bt, mask_bqk,
           cache: KVCache | None = None, cache_index=None, last_only: bool = False,
           layout: Layout = LOCAL, adapters: Any = None, lora_scale: float = 1.0):
    """(final hidden states [b, t, d] after the last norm, the output projection `head` in its
    compute layout: the embedding table [v, d] of a tied model, else the unembedding kernel
    [d, v], the updated cache or None). `unembed(dims, head, x)` finishes `forward`; the learner
    calls it a chunk of tokens at a time (`headrace.model.logprobs`).

    Args:
      params: the parameter tree (`nnx.to_pure_dict` form: "embed" / "layers" / ... ).
      mask_bqk: bool [b, t, k] (see the module docstring); sliding layers narrow it further.
      adapters: LoRA adapters (`headrace.model.lora`: {"layers": {i: {"attn": {"q": {"lora_a",
        "lora_b"}}}}}), applied on the fly with `lora_scale` (alpha / rank); None: none.
    """
    dtype = jnp.dtype(dims.dtype)
    table_vd = layout.param("embed.embedding", params["embed"]["embedding"])
    x_btd = layout.embed(table_vd, tokens_bt, dtype)
    if dims.embed_scale:
        x_btd = x_btd * jnp.asarray(dims.d_model ** 0.5, dtype)
    masks = {FULL: mask_bqk}
    if SLIDING in dims.layer_types:
        key_pos_bk = (jnp.arange(mask_bqk.shape[-1])[None] if cache is not None
                      else positions_bt)
        near_bqk = (positions_bt[:, :, None] - key_pos_bk[:, None, :]) < dims.sliding_window
        masks[SLIDING] = mask_bqk & near_bqk
    new_cache = []
    for i in range(dims.n_layers):
        block = layout.block(_block(dims, layout, i, last_only and i == dims.n_layers - 1,
                                    lora_scale))
        x_btd, kv = block(params["layers"][i], x_btd, positions_bt, masks[dims.layer_type(i)],
                          None if cache is None else cache[i], cache_index,
                          None if adapters is None else adapters["layers"].get(i))
        new_cache.append(kv)
    x_btd = rms_norm(x_btd, layout.param("final_norm.scale", params["final_norm"]["scale"]), dims)
    head = (table_vd if dims.tie_embeddings
            else layout.param("unembed.kernel", params["unembed"]["kernel"]))
    return x_btd, head, (new_cache if cache is not None else None)


# --- the parameters, as NNX modules (initialisation and structure) --------------------------------

class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, dtype, offset: bool = False):
        self.scale = nnx.Param((jnp.zeros if offset else jnp.ones)((dim,), dtype))


def _linear(d_in: int, d_out: int, dtype, rngs: nnx.Rngs, bias: bool = False) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs,
                      kernel_init=nnx.initializers.normal(stddev=d_in**-0.5))


class Attention(nnx.Module):
    def __init__(self, dims: ModelDims, dtype, rngs: nnx.Rngs):
        e, bias = dims.head_dim, dims.qkv_bias
        self.q = _linear(dims.d_model, dims.n_heads * e, dtype, rngs, bias)
        self.k = _linear(dims.d_model, dims.n_kv_heads * e, dtype, rngs, bias)
        self.v = _linear(dims.d_model, dims.n_kv_heads * e, dtype, rngs, bias)
        self.o = _linear(dims.n_heads * e, dims.d_model, dtype, rngs)
        if dims.qk_norm:
            self.q_norm = RMSNorm(e, dtype=dtype, offset=dims.norm_offset)
            self.k_norm = RMSNorm(e, dtype=dtype, offset=dims.norm_offset)


class GatedMLP(nnx.Module):
    def __init__(self, dims: ModelDims, dtype, rngs: nnx.Rngs):
        self.gate = _linear(dims.d_model, dims.d_ff, dtype, rngs)
        self.up = _linear(dims.d_model, dims.d_ff, dtype, rngs)
        self.down = _linear(dims.d_ff, dims.d_model, dtype, rngs)


class Block(nnx.Module):
    def __init__(self, dims: ModelDims, dtype, rngs: nnx.Rngs):
        norm = dict(dtype=dtype, offset=dims.norm_offset)
        self.attn_norm = RMSNorm(dims.d_model, **norm)
        self.attn = Attention(dims, dtype, rngs)
        self.mlp_norm = RMSNorm(dims.d_model, **norm)
        self.mlp = GatedMLP(dims, dtype, rngs)
        if dims.sandwich_norm:
            self.attn_post_norm = RMSNorm(dims.d_model, **norm)
            self.mlp_post_norm = RMSNorm(dims.d_model, **norm)


class Transformer(nnx.Module):
    """Decoder-only language model; `__call__` returns logits (float32) and the updated cache."""

    def __init__(self, dims: ModelDims, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(dims.dtype)
        self.dims = dims
        self.embed = nnx.Embed(dims.vocab_size, dims.d_model, dtype=dtype, param_dtype=dtype,
                               embedding_init=nnx.initializers.normal(stddev=1.0), rngs=rngs)
        self.layers = nnx.List([Block(dims, dtype, rngs) for _ in range(dims.n_layers)])
        self.final_norm = RMSNorm(dims.d_model, dtype=dtype, offset=dims.norm_offset)
        if not dims.tie_embeddings:
            self.unembed = _linear(dims.d_model, dims.vocab_size, dtype, rngs)

    def __call__(self, tokens_bt, positions_bt, mask_bqk, cache: KVCache | None = None,
                 cache_index=None, last_only: bool = False):
        params = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        return forward(self.dims, params, tokens_bt, positions_bt, mask_bqk, cache, cache_index,
                       last_only)

    def init_cache(self, batch: int, slots: int) -> KVCache:
        d = self.dims
        shape = (batch, slots, d.n_kv_heads, d.head_dim)
        dtype = jnp.dtype(d.dtype)
        return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(d.n_layers)]


def segment_mask(segment_ids_bt: jax.Array) -> jax.Array:
    """mask_bqk for packed rows: causal, within the same segment, never on padding (segment 0)."""
    t = segment_ids_bt.shape[1]
    causal_qk = jnp.tril(jnp.ones((t, t), dtype=bool))
    same_bqk = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    real_bk = (segment_ids_bt != 0)[:, None, :]
    return causal_qk[None] & same_bqk & real_bk


def build_model(dims: ModelDims, seed: int) -> Transformer:
    return Transformer(dims, rngs=nnx.Rngs(params=seed))
