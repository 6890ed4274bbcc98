"""The sampler's device programs: prefill a call's new tokens, then decode `max_new` tokens.

Pure functions of named arguments (jitted by `headrace.model.sampler`): a `Request` holds one
call's rows, `Sampling` the decoding parameters that are traced (the same program serves any
value), and the decode loop's carry is a `DecodeState`. Every token's log-probability is that of
the temperature-scaled, untruncated distribution (the one the learner evaluates); top-k, top-p and
the action constraint only choose the token.

With `top` > 0 (a separate compiled variant: the static argument is part of the program) the
programs also return, per generated token, the `top` most likely token ids of that distribution
and their log-probs (`jax.lax.top_k` on the device, in the decode loop); with `top` = 0 nothing of
it is traced, so the normal programs are unchanged.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from headrace.model import params as params_lib
from headrace.model.distribution import policy_logits
from headrace.model.transformer import KVCache


class Sampling(NamedTuple):
    """Decoding parameters passed as arrays (traced: one program serves every value)."""

    temperature: jax.Array  # f32[]
    top_p: jax.Array  # f32[]
    allowed_v: jax.Array  # bool[V]: the tokens decoding may choose
    stop_v: jax.Array  # bool[V]: the tokens that end a row's turn
    pad_id: jax.Array  # i32[]: what a row emits once it stopped


class Request(NamedTuple):
    """One call's rows: each row's new tokens, right-aligned, after its first `start_b` positions
    (those its kept cache holds; 0 for a fresh context)."""

    tokens_bw: jax.Array  # i32[b, w]
    valid_bw: jax.Array  # bool[b, w]: the new tokens (left of them: padding)
    start_b: jax.Array  # i32[b]


class Decoded(NamedTuple):
    """A call's result: `lengths_b` tokens per row were generated (the rest is padding)."""

    tokens_bg: jax.Array  # i32[b, max_new]
    logps_bg: jax.Array  # f32[b, max_new]: 0 past a row's length
    lengths_b: jax.Array  # i32[b]
    # with `top` > 0: per token the `top` likeliest ids and their log-probs, most likely first
    top_ids_bgk: jax.Array | None = None  # i32[b, max_new, top]
    top_logps_bgk: jax.Array | None = None  # f32[b, max_new, top]


class DecodeState(NamedTuple):
    """The decode loop's carry."""

    logits_bv: jax.Array  # f32[b, V]: the next token's logits
    cache: KVCache  # per layer (keys, values), each [b, S, g, e]; slot j holds position j
    key_valid_bs: jax.Array  # bool[b, S]: the slots written so far
    done_b: jax.Array  # bool[b]: the row emitted a stop token
    rng: jax.Array


def choose(logits_bv, rng, sampling: Sampling, *, top_k: int, use_top_p: bool, greedy: bool,
           top: int = 0):
    """Picks one token per row; returns it, its log-prob under the untruncated distribution and
    (`top` > 0) that distribution's `top` likeliest (ids i32[b, top], log-probs f32[b, top]),
    else None."""
    policy_bv = policy_logits(logits_bv, sampling.temperature, sampling.allowed_v)
    logp_full_bv = jax.nn.log_softmax(policy_bv, axis=-1)
    choice_bv = jnp.where(sampling.allowed_v[None, :], policy_bv, -jnp.inf)
    if top_k:
        kth_b = jax.lax.top_k(choice_bv, top_k)[0][:, -1]
        choice_bv = jnp.where(choice_bv >= kth_b[:, None], choice_bv, -jnp.inf)
    if use_top_p:
        sorted_bv = jnp.sort(choice_bv, axis=-1)[:, ::-1]
        probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
        mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
        cutoff_b = jnp.min(jnp.where(mass_before_bv < sampling.top_p, sorted_bv, jnp.inf),
                           axis=-1)
        choice_bv = jnp.where(choice_bv >= cutoff_b[:, None], choice_bv, -jnp.inf)
    if greedy:
        token_b = jnp.argmax(choice_bv, axis=-1)
    else:
        token_b = jax.random.categorical(rng, choice_bv, axis=-1)
    logp_b = jnp.take_along_axis(logp_full_bv, token_b[:, None], axis=-1)[:, 0]
    tops = None
    if top:
        top_logps_bk, top_ids_bk = jax.lax.top_k(logp_full_bv, top)
        tops = (top_ids_bk.astype(jnp.int32), top_logps_bk)
    return token_b.astype(jnp.int32), logp_b, tops


def generate(graphdef, params, request: Request, sampling: Sampling, rng,
             cache: KVCache | None = None, *, max_new: int, top_k: int, use_top_p: bool,
             greedy: bool, top: int = 0) -> tuple[Decoded, jax.Array, KVCache | None]:
    """Prefills each row's new tokens after its first `start_b` positions, then decodes.

    `cache`: per layer a key and a value array [b, S, g, e] whose slot j holds position j (so
    slots below `start_b` are the row's earlier positions), or None for a fresh call: every start
    is 0, and a cache of w + max_new slots is made here (none at all when one token is
    generated). With `top` > 0 the decoded result carries each token's `top` alternatives.
    Returns (decoded, rng, cache).
    """
    model = params_lib.merge(graphdef, params)
    tokens_bw, valid_bw, start_b = request
    b, w = tokens_bw.shape
    pick = functools.partial(choose, sampling=sampling, top_k=top_k, use_top_p=use_top_p,
                             greedy=greedy, top=top)
    positions_bw = start_b[:, None] + jnp.maximum(jnp.cumsum(valid_bw, axis=1) - 1, 0)
    if cache is None and max_new == 1:  # one token per turn: a plain forward, no cache to write
        causal_qk = jnp.arange(w)[None, :] <= jnp.arange(w)[:, None]
        logits_bwv, _ = model(tokens_bw, positions_bw, valid_bw[:, None, :] & causal_qk[None],
                              last_only=True)  # right-aligned: -1 is the last token
        rng, sub = jax.random.split(rng)
        token_b, logp_b, tops = pick(logits_bwv[:, -1], sub)
        tops = (None, None) if tops is None else (tops[0][:, None], tops[1][:, None])
        return Decoded(token_b[:, None], logp_b[:, None], jnp.ones((b,), jnp.int32),
                       *tops), rng, None
    if cache is None:
        cache = model.init_cache(b, w + max_new)
    slots = cache[0][0].shape[1]
    slot_s = jnp.arange(slots)
    key_valid_bs = slot_s[None, :] < (start_b + jnp.sum(valid_bw, axis=1))[:, None]
    prefill_mask_bws = key_valid_bs[:, None, :] & (slot_s[None, None, :] <= positions_bw[..., None])
    write_bw = jnp.where(valid_bw, positions_bw, slots)  # padding's keys are not written
    logits_bwv, cache = model(tokens_bw, positions_bw, prefill_mask_bws, cache, write_bw,
                              last_only=True)
    next_b = positions_bw[:, -1] + 1

    def step(state: DecodeState, t):
        rng, sub = jax.random.split(state.rng)
        token_b, logp_b, tops = pick(state.logits_bv, sub)
        emitted_b = ~state.done_b
        token_b = jnp.where(emitted_b, token_b, sampling.pad_id)
        logp_b = jnp.where(emitted_b, logp_b, 0.0)
        done_b = state.done_b | sampling.stop_v[token_b]
        slot_b1 = (next_b + t)[:, None]
        key_valid_bs = state.key_valid_bs | (slot_s[None, :] == slot_b1)
        mask_b1s = (key_valid_bs & (slot_s[None, :] <= slot_b1))[:, None, :]
        logits_b1v, cache = model(token_b[:, None], slot_b1, mask_b1s, state.cache, slot_b1)
        return (DecodeState(logits_b1v[:, 0], cache, key_valid_bs, done_b, rng),
                (token_b, logp_b, emitted_b, tops))

    state = DecodeState(logits_bwv[:, -1], cache, key_valid_bs, jnp.zeros((b,), bool), rng)
    state, (tokens_gb, logps_gb, emitted_gb, tops_g) = jax.lax.scan(step, state,
                                                                    jnp.arange(max_new - 1))
    rng, sub = jax.random.split(state.rng)
    last_b, last_logp_b, last_tops = pick(state.logits_bv, sub)
    last_emitted_b = ~state.done_b
    tokens_bg = jnp.concatenate(
        [tokens_gb.T, jnp.where(last_emitted_b, last_b, sampling.pad_id)[:, None]], 1)
    logps_bg = jnp.concatenate(
        [logps_gb.T, jnp.where(last_emitted_b, last_logp_b, 0.0)[:, None]], 1)
    lengths_b = jnp.sum(emitted_gb, axis=0) + last_emitted_b
    tops = (None, None)
    if top:  # (g, b, k) from the loop, then the last token's (b, k): rows first
        tops = tuple(jnp.concatenate([jnp.swapaxes(a_gbk, 0, 1), a_bk[:, None]], 1)
                     for a_gbk, a_bk in zip(tops_g, last_tops))
    return Decoded(tokens_bg, logps_bg, lengths_b.astype(jnp.int32), *tops), rng, state.cache


def generate_in_pool(graphdef, params, pool: KVCache, slot_b, request: Request,
                     sampling: Sampling, rng, *, span: int,
                     **static) -> tuple[Decoded, jax.Array, KVCache]:
    """`generate` over the episodes' kept caches: rows `slot_b` of `pool` (per layer a key and a
    value array [episodes + 1, largest bucket, g, e]), their first `span` slots; returns the pool
    with those rows written back (the pool is donated: updated in place)."""
    cache = [(k[slot_b, :span], v[slot_b, :span]) for k, v in pool]
    decoded, rng, cache = generate(graphdef, params, request, sampling, rng, cache, **static)
    pool = [(k.at[slot_b, :span].set(ck), v.at[slot_b, :span].set(cv))
            for (k, v), (ck, cv) in zip(pool, cache)]
    return decoded, rng, pool
