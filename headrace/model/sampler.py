"""A jitted KV-cache sampler with bucketed shapes.

`Sampler.generate` takes a batch of token contexts of any lengths and returns, per row, the generated
tokens and their log-probabilities **under the temperature-scaled, untruncated distribution** (the
distribution the learner evaluates); top-k, top-p and the action constraint only choose the token.

Shapes come from a bounded set: rows are served in calls whose sizes come from a coarse ladder
(`max_batch`, `max_batch / 4`, ...; `shapes.split_rows` splits a bucket's rows where that at least
halves the rows computed, else pads them into one call), contexts are left-padded to the smallest
length bucket that holds them, and every call generates exactly `max_new_tokens` steps (rows that
hit a stop token keep running, masked). So the number of compiled programs is at most
|batch sizes| x |buckets| per decoding mode (sampled, greedy). The prefill computes the last
layer's queries, feed-forward and logits at the last position only (`Transformer(last_only=True)`).

Failure modes: a context that cannot fit (`len + max_new_tokens > largest bucket`) raises
`PromptTooLong` before any device work; the caller ends that episode as truncated.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from headrace.model import params as params_lib
from headrace.model.distribution import policy_logits
from headrace.shapes import batch_ladder, bucket_for, split_rows


class PromptTooLong(ValueError):
    """A context plus the generation length does not fit the largest length bucket."""


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 1
    pad_id: int = 0
    stop_ids: tuple[int, ...] = ()
    allowed_ids: tuple[int, ...] | None = None  # constrain decoding to these tokens (None: any)

    def allowed_mask(self, vocab_size: int) -> np.ndarray | None:
        """bool[vocab] of the tokens the policy may emit, or None when decoding is unconstrained."""
        if self.allowed_ids is None:
            return None
        mask = np.zeros(vocab_size, bool)
        mask[list(self.allowed_ids)] = True
        return mask


def _choose(logits_bv, rng, temperature, top_p, allowed_v, *, top_k: int, use_top_p: bool,
            greedy: bool):
    """Picks one token per row; returns it and its log-prob under the untruncated distribution."""
    policy_bv = policy_logits(logits_bv, temperature, allowed_v)
    logp_full_bv = jax.nn.log_softmax(policy_bv, axis=-1)
    choice_bv = jnp.where(allowed_v[None, :], policy_bv, -jnp.inf)
    if top_k:
        kth_b = jax.lax.top_k(choice_bv, top_k)[0][:, -1]
        choice_bv = jnp.where(choice_bv >= kth_b[:, None], choice_bv, -jnp.inf)
    if use_top_p:
        sorted_bv = jnp.sort(choice_bv, axis=-1)[:, ::-1]
        probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
        mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
        cutoff_b = jnp.min(jnp.where(mass_before_bv < top_p, sorted_bv, jnp.inf), axis=-1)
        choice_bv = jnp.where(choice_bv >= cutoff_b[:, None], choice_bv, -jnp.inf)
    if greedy:
        token_b = jnp.argmax(choice_bv, axis=-1)
    else:
        token_b = jax.random.categorical(rng, choice_bv, axis=-1)
    logp_b = jnp.take_along_axis(logp_full_bv, token_b[:, None], axis=-1)[:, 0]
    return token_b.astype(jnp.int32), logp_b


def _generate(graphdef, params, tokens_bp, valid_bp, rng, temperature, top_p, allowed_v, stop_v,
              pad_id, *, max_new: int, top_k: int, use_top_p: bool, greedy: bool):
    model = params_lib.merge(graphdef, params)
    b, p = tokens_bp.shape
    choose = functools.partial(_choose, top_k=top_k, use_top_p=use_top_p, greedy=greedy)
    positions_bp = jnp.maximum(jnp.cumsum(valid_bp, axis=1) - 1, 0)
    causal_qk = jnp.arange(p)[None, :] <= jnp.arange(p)[:, None]
    if max_new == 1:  # one token per turn: a plain forward, no cache to write
        logits_bpv, _ = model(tokens_bp, positions_bp, valid_bp[:, None, :] & causal_qk[None],
                              last_only=True)  # contexts are left-padded: -1 is the last token
        rng, sub = jax.random.split(rng)
        token_b, logp_b = choose(logits_bpv[:, -1], sub, temperature, top_p, allowed_v)
        return token_b[:, None], logp_b[:, None], jnp.ones((b,), jnp.int32), rng

    slots = p + max_new
    slot_s = jnp.arange(slots)
    key_valid_bs = jnp.concatenate([valid_bp, jnp.zeros((b, max_new), bool)], axis=1)
    prefill_mask_bqk = key_valid_bs[:, None, :] & (slot_s[None, None, :] <= jnp.arange(p)[None, :, None])
    logits_bpv, cache = model(tokens_bp, positions_bp, prefill_mask_bqk,
                              model.init_cache(b, slots), 0, last_only=True)
    next_pos_b = positions_bp[:, -1] + 1

    def step(carry, t):
        logits_bv, cache, key_valid_bs, done_b, rng = carry
        rng, sub = jax.random.split(rng)
        token_b, logp_b = choose(logits_bv, sub, temperature, top_p, allowed_v)
        emitted_b = ~done_b
        token_b = jnp.where(emitted_b, token_b, pad_id)
        logp_b = jnp.where(emitted_b, logp_b, 0.0)
        done_b = done_b | stop_v[token_b]
        slot = p + t
        key_valid_bs = key_valid_bs.at[:, slot].set(True)
        mask_bqk = (key_valid_bs & (slot_s[None, :] <= slot))[:, None, :]
        logits_b1v, cache = model(token_b[:, None], (next_pos_b + t)[:, None], mask_bqk, cache, slot)
        return (logits_b1v[:, 0], cache, key_valid_bs, done_b, rng), (token_b, logp_b, emitted_b)

    carry = (logits_bpv[:, -1], cache, key_valid_bs, jnp.zeros((b,), bool), rng)
    carry, (tokens_gb, logps_gb, emitted_gb) = jax.lax.scan(step, carry, jnp.arange(max_new - 1))
    logits_bv, _, _, done_b, rng = carry
    rng, sub = jax.random.split(rng)
    last_b, last_logp_b = choose(logits_bv, sub, temperature, top_p, allowed_v)
    last_emitted_b = ~done_b
    tokens_bg = jnp.concatenate([tokens_gb.T, jnp.where(last_emitted_b, last_b, pad_id)[:, None]], 1)
    logps_bg = jnp.concatenate([logps_gb.T, jnp.where(last_emitted_b, last_logp_b, 0.0)[:, None]], 1)
    lengths_b = jnp.sum(emitted_gb, axis=0) + last_emitted_b
    return tokens_bg, logps_bg, lengths_b.astype(jnp.int32), rng


class Sampler:
    """Generates continuations for batches of contexts with the current weights.

    Thread-safe: `set_params` may be called from another thread between `generate` calls; each call
    uses one consistent (params, version) pair.
    """

    def __init__(self, graphdef, settings: SamplerSettings, vocab_size: int,
                 buckets: Sequence[int], max_batch: int, seed: int = 0):
        self.settings = settings
        self.buckets = tuple(buckets)
        self.batch_sizes = batch_ladder(max_batch)
        self._lock = threading.Lock()
        self._params = None
        self.version = -1
        self._rng = jax.random.key(seed)
        # Constrained decoding picks one action word (one token each) per turn, so each allowed
        # token also ends the turn; unconstrained decoding ends at a stop token.
        stop = np.zeros(vocab_size, bool)
        stop[list(settings.stop_ids)] = True
        allowed = settings.allowed_mask(vocab_size)
        if allowed is None:
            allowed = np.ones(vocab_size, bool)
        else:
            stop |= allowed
        self._allowed_v = jnp.asarray(allowed)
        self._stop_v = jnp.asarray(stop)
        self._fns = {}
        for greedy in (False, True):
            self._fns[greedy] = jax.jit(functools.partial(
                _generate, graphdef, max_new=settings.max_new_tokens, top_k=settings.top_k,
                use_top_p=settings.top_p < 1.0, greedy=greedy))

    def set_params(self, params, version: int) -> None:
        with self._lock:
            self._params, self.version = params, version

    def max_context(self) -> int:
        return self.buckets[-1] - self.settings.max_new_tokens

    def generate(self, contexts: Sequence[Sequence[int]], greedy: bool = False):
        """Returns (tokens, logprobs, version): per context an int32 and a float32 array.

        Contexts are grouped by length bucket and each group runs as its own call, so a row pays
        for its own bucket, not for the longest context of the batch. All rows use one consistent
        weights version.

        Raises:
          PromptTooLong: some context is longer than `max_context()`.
          ValueError: more contexts than `max_batch`.
        """
        s = self.settings
        longest = max(len(c) for c in contexts)
        if longest > self.max_context():
            raise PromptTooLong(f"context of {longest} tokens + {s.max_new_tokens} new does not "
                                f"fit the largest bucket {self.buckets[-1]}")
        if len(contexts) > self.batch_sizes[-1]:
            raise ValueError(f"{len(contexts)} contexts exceed max_batch={self.batch_sizes[-1]}")
        with self._lock:
            params, version = self._params, self.version
        if params is None:
            raise RuntimeError("Sampler.generate called before set_params")
        by_bucket: dict[int, list[int]] = {}
        for i, context in enumerate(contexts):
            width = bucket_for(len(context) + s.max_new_tokens, self.buckets) - s.max_new_tokens
            by_bucket.setdefault(width, []).append(i)
        out_tokens: list[np.ndarray] = [None] * len(contexts)
        out_logps: list[np.ndarray] = [None] * len(contexts)
        for width, rows in by_bucket.items():
            tokens, logps = self._generate_rows(params, [contexts[i] for i in rows], width, greedy)
            for i, t, lp in zip(rows, tokens, logps):
                out_tokens[i], out_logps[i] = t, lp
        return out_tokens, out_logps, version

    def _generate_rows(self, params, contexts, width: int, greedy: bool):
        """One bucket's rows, in calls of batch-ladder sizes (`split_rows`: little padding), all
        dispatched before their results are fetched at once."""
        s = self.settings
        results, start = [], 0
        for rows in split_rows(len(contexts), self.batch_sizes):
            chunk = contexts[start:start + rows]
            start += len(chunk)
            tokens_bp = np.full((rows, width), s.pad_id, np.int32)
            valid_bp = np.zeros((rows, width), bool)
            for i, context in enumerate(chunk):
                tokens_bp[i, width - len(context):] = context
                valid_bp[i, width - len(context):] = True
            valid_bp[len(chunk):, -1] = True  # padding rows see one token: none attends to nothing
            tokens_bg, logps_bg, lengths_b, self._rng = self._fns[greedy](
                params, tokens_bp, valid_bp, self._rng, np.float32(s.temperature),
                np.float32(s.top_p), self._allowed_v, self._stop_v, np.int32(s.pad_id))
            results.append((len(chunk), tokens_bg, logps_bg, lengths_b))
        # Deliberate device->host sync: the actor needs the tokens to step the environments.
        results = jax.device_get(results)
        tokens, logps = [], []
        for n, tokens_bg, logps_bg, lengths_b in results:
            tokens.extend(tokens_bg[i, :lengths_b[i]] for i in range(n))
            logps.extend(logps_bg[i, :lengths_b[i]] for i in range(n))
        return tokens, logps
