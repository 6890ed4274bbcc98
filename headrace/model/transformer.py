"""A Llama-style decoder-only transformer in Flax NNX: RoPE, RMSNorm, SwiGLU, grouped-query attention.

One forward function serves training and sampling. Attention takes an explicit boolean mask
`mask_bqk` (query row may see key slot), so the caller decides what is visible: causal within a
segment for packed training rows, or "written cache slots up to the query" while decoding. With a
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

import jax
import jax.numpy as jnp
from flax import nnx

from headrace.config import ModelConfig

KVCache = list[tuple[jax.Array, jax.Array]]  # per layer: k_bsge, v_bsge
# Queries per attention tile over a long causal input. Measured on CPU (fwd + bwd, 4,096 positions,
# 2 heads of 16): one [t, t] score matrix 0.93 s, tiles of 1,024 / 256 / 128 queries 0.53 / 0.25 /
# 0.22 s, compile 0.3 / 2.5 / 5 s: the tiles skip the keys after them (about half the work) and
# keep each tile's scores in cache. 256 balances step time against compile time per shape.
QUERY_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """Resolved sizes (the vocabulary comes from the tokenizer)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_config(cls, config: ModelConfig, vocab_size: int) -> ModelDims:
        return cls(vocab_size=config.vocab_size or vocab_size, d_model=config.d_model,
                   n_layers=config.n_layers, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
                   d_ff=config.d_ff, dtype=config.dtype)


def rope(x_bthe: jax.Array, positions_bt: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding (Su et al. 2021, RoFormer), rotate-half form."""
    half = x_bthe.shape[-1] // 2
    inv_freq_e = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_bte = positions_bt[..., None].astype(jnp.float32) * inv_freq_e
    sin, cos = jnp.sin(angle_bte)[:, :, None, :], jnp.cos(angle_bte)[:, :, None, :]
    x1, x2 = x_bthe[..., :half].astype(jnp.float32), x_bthe[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bthe.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, dtype, eps: float = 1e-6):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        x32 = x_btd.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x_btd.dtype)


def _dense(d_in: int, d_out: int, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs,
                      kernel_init=nnx.initializers.normal(stddev=d_in**-0.5))


def _softmax_attention(q_btgre, k_bsge, v_bsge, mask_bqk):
    scores_bgrts = jnp.einsum("btgre,bsge->bgrts", q_btgre, k_bsge).astype(jnp.float32)
    scores_bgrts = scores_bgrts * (q_btgre.shape[-1] ** -0.5)
    scores_bgrts = jnp.where(mask_bqk[:, None, None], scores_bgrts, -1e30)
    probs_bgrts = jax.nn.softmax(scores_bgrts, axis=-1).astype(q_btgre.dtype)
    return jnp.einsum("bgrts,bsge->btgre", probs_bgrts, v_bsge)


def attend(q_btgre, k_bsge, v_bsge, mask_bqk, *, causal: bool):
    """Grouped-query softmax attention of queries [b, t, g, r, e] over keys and values [b, s, g, e]
    where `mask_bqk` allows. With `causal` (queries and keys are the same positions and no query sees
    a later one) a long input goes in tiles of `QUERY_CHUNK` queries, each over the keys up to its
    last query: the keys it skips are masked for it anyway, so the result is the same (padding
    queries that see no key at all are the one exception; nothing reads them). The tiles are
    unrolled, static shapes."""
    t = q_btgre.shape[1]
    if not causal or t <= QUERY_CHUNK:
        return _softmax_attention(q_btgre, k_bsge, v_bsge, mask_bqk)
    tiles = []
    for lo in range(0, t, QUERY_CHUNK):
        hi = min(lo + QUERY_CHUNK, t)
        tiles.append(_softmax_attention(q_btgre[:, lo:hi], k_bsge[:, :hi], v_bsge[:, :hi],
                                        mask_bqk[:, lo:hi, :hi]))
    return jnp.concatenate(tiles, axis=1)


class Attention(nnx.Module):
    def __init__(self, dims: ModelDims, dtype, rngs: nnx.Rngs):
        self.dims = dims
        e = dims.head_dim
        self.q = _dense(dims.d_model, dims.n_heads * e, dtype, rngs)
        self.k = _dense(dims.d_model, dims.n_kv_heads * e, dtype, rngs)
        self.v = _dense(dims.d_model, dims.n_kv_heads * e, dtype, rngs)
        self.o = _dense(dims.n_heads * e, dims.d_model, dtype, rngs)

    def __call__(self, x_btd, positions_bt, mask_bqk, cache_kv=None, cache_index=None,
                 last_only: bool = False):
        d = self.dims
        b, t, _ = x_btd.shape
        e, g, r = d.head_dim, d.n_kv_heads, d.n_heads // d.n_kv_heads
        x_bqd = x_btd[:, -1:] if last_only else x_btd  # queries: the last position, or all
        t_q = x_bqd.shape[1]
        q_bthe = rope(self.q(x_bqd).reshape(b, t_q, d.n_heads, e), positions_bt[:, -t_q:])
        mask_bqk = mask_bqk[:, -t_q:]
        k_btge = rope(self.k(x_btd).reshape(b, t, g, e), positions_bt)
        v_btge = self.v(x_btd).reshape(b, t, g, e)
        if cache_kv is not None:  # cache_index_bt: each token's slot
            rows_b1 = jnp.arange(b)[:, None]
            k_bsge = cache_kv[0].at[rows_b1, cache_index].set(k_btge, mode="drop")
            v_bsge = cache_kv[1].at[rows_b1, cache_index].set(v_btge, mode="drop")
            cache_kv = (k_bsge, v_bsge)
        else:
            k_bsge, v_bsge = k_btge, v_btge
        out_btgre = attend(q_bthe.reshape(b, t_q, g, r, e), k_bsge, v_bsge, mask_bqk,
                           causal=cache_kv is None and not last_only)
        return self.o(out_btgre.reshape(b, t_q, d.n_heads * e)), cache_kv


class SwiGLU(nnx.Module):
    """Gated feed-forward (Shazeer 2020, "GLU Variants Improve Transformer")."""

    def __init__(self, dims: ModelDims, dtype, rngs: nnx.Rngs):
        self.gate = _dense(dims.d_model, dims.d_ff, dtype, rngs)
        self.up = _dense(dims.d_model, dims.d_ff, dtype, rngs)
        self.down = _dense(dims.d_ff, dims.d_model, dtype, rngs)

    def __call__(self, x_btd):
        return self.down(jax.nn.silu(self.gate(x_btd)) * self.up(x_btd))


class Block(nnx.Module):
    def __init__(self, dims: ModelDims, dtype, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(dims.d_model, dtype=dtype)
        self.attn = Attention(dims, dtype, rngs)
        self.mlp_norm = RMSNorm(dims.d_model, dtype=dtype)
        self.mlp = SwiGLU(dims, dtype, rngs)

    def __call__(self, x_btd, positions_bt, mask_bqk, cache_kv=None, cache_index=None,
                 last_only: bool = False):
        h_btd, cache_kv = self.attn(self.attn_norm(x_btd), positions_bt, mask_bqk, cache_kv,
                                    cache_index, last_only)
        x_btd = (x_btd[:, -1:] if last_only else x_btd) + h_btd
        return x_btd + self.mlp(self.mlp_norm(x_btd)), cache_kv


class Transformer(nnx.Module):
    """Decoder-only language model; `__call__` returns logits (float32) and the updated cache."""

    def __init__(self, dims: ModelDims, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(dims.dtype)
        self.dims = dims
        self.embed = nnx.Embed(dims.vocab_size, dims.d_model, dtype=dtype, param_dtype=dtype,
                               embedding_init=nnx.initializers.normal(stddev=1.0), rngs=rngs)
        self.layers = nnx.List([Block(dims, dtype, rngs) for _ in range(dims.n_layers)])
        self.final_norm = RMSNorm(dims.d_model, dtype=dtype)
        self.unembed = _dense(dims.d_model, dims.vocab_size, dtype, rngs)

    def __call__(self, tokens_bt, positions_bt, mask_bqk, cache: KVCache | None = None,
                 cache_index=None, last_only: bool = False):
        x_btd = self.embed(tokens_bt)
        new_cache = []
        for i, layer in enumerate(self.layers):
            x_btd, kv = layer(x_btd, positions_bt, mask_bqk,
                              None if cache is None else cache[i], cache_index,
                              last_only and i == len(self.layers) - 1)
            new_cache.append(kv)
        logits_btv = self.unembed(self.final_norm(x_btd)).astype(jnp.float32)
        return logits_btv, (new_cache if cache is not None else None)

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
