"""A jitted KV-cache sampler with bucketed shapes.

`Sampler.generate` takes a batch of token contexts of any lengths and returns, per row, the generated
tokens and their log-probabilities **under the temperature-scaled, untruncated distribution** (the
distribution the learner evaluates); top-k, top-p and the action constraint only choose the token.

Shapes come from a bounded set: rows are served in calls whose sizes come from a coarse ladder
(`max_batch`, `max_batch / 4`, ...; `shapes.split_rows` splits a bucket's rows where that at least
halves the rows computed, else pads them into one call), contexts are left-padded to the smallest
length bucket that holds them, and every call generates exactly `max_new_tokens` steps (rows that
hit a stop token keep running, masked). So the number of compiled programs is at most
|batch sizes| x |buckets| per decoding mode (sampled, greedy); kept caches (`episodes`, see
`generate`) add at most |batch sizes| x (2 |buckets| - 1) more. The prefill computes the last
layer's queries, feed-forward and logits at the last position only (`Transformer(last_only=True)`).

Compiling in the background (`background_compiles`, an actor's sampler): a call whose shape has
no compiled program yet does not wait for one. The program compiles on a background thread while
the call's rows ride in programs already compiled (a wider length bucket, other row counts); only
a call that no compiled program can serve waits (`inline_compiles`: the first calls). A compile
takes seconds on a CPU and every episode of the actor waits on the call, so compiling in line
mid-run stalls the whole pool at once (and synchronises its episodes into waves).

Failure modes: a context that cannot fit (`len + max_new_tokens > largest bucket`) raises
`PromptTooLong` before any device work; the caller ends that episode as truncated.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from headrace.model import params as params_lib
from headrace.model.distribution import policy_logits
from headrace.shapes import batch_ladder, bucket_for, split_rows

log = logging.getLogger(__name__)


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


def _generate(graphdef, params, tokens_bw, valid_bw, start_b, rng, temperature, top_p, allowed_v,
              stop_v, pad_id, cache=None, *, max_new: int, top_k: int, use_top_p: bool,
              greedy: bool):
    """Prefills each row's new tokens after its first `start_b` positions, then decodes.

    `tokens_bw` holds the new tokens right-aligned (`valid_bw` marks them). `cache` is per layer a
    key and a value array [b, S, g, e] whose slot j holds position j (so slots below `start_b`
    are the row's earlier positions), or None for a fresh call: every start is 0, and a cache of
    w + max_new slots is made here (none at all when one token is generated). Returns (tokens_bg,
    logps_bg, lengths_b, rng, cache).
    """
    model = params_lib.merge(graphdef, params)
    b, w = tokens_bw.shape
    choose = functools.partial(_choose, top_k=top_k, use_top_p=use_top_p, greedy=greedy)
    positions_bw = start_b[:, None] + jnp.maximum(jnp.cumsum(valid_bw, axis=1) - 1, 0)
    if cache is None and max_new == 1:  # one token per turn: a plain forward, no cache to write
        causal_qk = jnp.arange(w)[None, :] <= jnp.arange(w)[:, None]
        logits_bwv, _ = model(tokens_bw, positions_bw, valid_bw[:, None, :] & causal_qk[None],
                              last_only=True)  # right-aligned: -1 is the last token
        rng, sub = jax.random.split(rng)
        token_b, logp_b = choose(logits_bwv[:, -1], sub, temperature, top_p, allowed_v)
        return token_b[:, None], logp_b[:, None], jnp.ones((b,), jnp.int32), rng, None
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

    def step(carry, t):
        logits_bv, cache, key_valid_bs, done_b, rng = carry
        rng, sub = jax.random.split(rng)
        token_b, logp_b = choose(logits_bv, sub, temperature, top_p, allowed_v)
        emitted_b = ~done_b
        token_b = jnp.where(emitted_b, token_b, pad_id)
        logp_b = jnp.where(emitted_b, logp_b, 0.0)
        done_b = done_b | stop_v[token_b]
        slot_b1 = (next_b + t)[:, None]
        key_valid_bs = key_valid_bs | (slot_s[None, :] == slot_b1)
        mask_b1s = (key_valid_bs & (slot_s[None, :] <= slot_b1))[:, None, :]
        logits_b1v, cache = model(token_b[:, None], slot_b1, mask_b1s, cache, slot_b1)
        return (logits_b1v[:, 0], cache, key_valid_bs, done_b, rng), (token_b, logp_b, emitted_b)

    carry = (logits_bwv[:, -1], cache, key_valid_bs, jnp.zeros((b,), bool), rng)
    carry, (tokens_gb, logps_gb, emitted_gb) = jax.lax.scan(step, carry, jnp.arange(max_new - 1))
    logits_bv, cache, _, done_b, rng = carry
    rng, sub = jax.random.split(rng)
    last_b, last_logp_b = choose(logits_bv, sub, temperature, top_p, allowed_v)
    last_emitted_b = ~done_b
    tokens_bg = jnp.concatenate([tokens_gb.T, jnp.where(last_emitted_b, last_b, pad_id)[:, None]], 1)
    logps_bg = jnp.concatenate([logps_gb.T, jnp.where(last_emitted_b, last_logp_b, 0.0)[:, None]], 1)
    lengths_b = jnp.sum(emitted_gb, axis=0) + last_emitted_b
    return tokens_bg, logps_bg, lengths_b.astype(jnp.int32), rng, cache


def _generate_in_pool(graphdef, params, pool, slot_b, tokens_bw, valid_bw, start_b, rng, *args,
                      span: int, **kwargs):
    """`_generate` over the episodes' kept caches: rows `slot_b` of `pool` (per layer a key and a
    value array [episodes + 1, largest bucket, g, e]), their first `span` slots; returns the pool
    with those rows written back (the pool is donated: updated in place)."""
    cache = [(k[slot_b, :span], v[slot_b, :span]) for k, v in pool]
    *out, cache = _generate(graphdef, params, tokens_bw, valid_bw, start_b, rng, *args, cache,
                            **kwargs)
    pool = [(k.at[slot_b, :span].set(ck), v.at[slot_b, :span].set(cv))
            for (k, v), (ck, cv) in zip(pool, cache)]
    return (*out, pool)


class Sampler:
    """Generates continuations for batches of contexts with the current weights.

    Thread-safe: `set_params` may be called from another thread between `generate` calls; each call
    uses one consistent (params, version) pair.
    """

    def __init__(self, graphdef, settings: SamplerSettings, vocab_size: int,
                 buckets: Sequence[int], max_batch: int, seed: int = 0, episodes: int = 0,
                 background_compiles: bool = False):
        self.settings = settings
        self.episodes = episodes  # episodes whose caches are kept across turns (slots 0..n-1)
        self._graphdef = graphdef
        self._pool = None  # their caches, made on first use
        self._pool_shapes = None
        self._kept: list[np.ndarray | None] = [None] * episodes  # the tokens each slot holds
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
        self._fns, self._pool_fns = {}, {}
        for greedy in (False, True):
            static = dict(max_new=settings.max_new_tokens, top_k=settings.top_k,
                          use_top_p=settings.top_p < 1.0, greedy=greedy)
            self._fns[greedy] = jax.jit(functools.partial(_generate, graphdef, **static))
            self._pool_fns[greedy] = jax.jit(
                functools.partial(_generate_in_pool, graphdef, **static),
                static_argnames=("span",), donate_argnums=(1,))
        # Compiled programs by (greedy, span, rows, width); span is None without kept caches.
        self._programs: dict[tuple, object] = {}
        self._compiler = (concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="sampler-compile") if background_compiles else None)
        self._compiling: dict[tuple, concurrent.futures.Future] = {}
        self.compiles = 0  # programs compiled
        self.inline_compiles = 0  # of them, those a call waited for

    def set_params(self, params, version: int) -> None:
        with self._lock:
            self._params, self.version = params, version

    def max_context(self) -> int:
        return self.buckets[-1] - self.settings.max_new_tokens

    def generate(self, contexts: Sequence[Sequence[int]], greedy: bool = False,
                 slots: Sequence[int] | None = None):
        """Returns (tokens, logprobs, version): per context an int32 and a float32 array.

        Contexts are grouped by length bucket and each group runs as its own call, so a row pays
        for its own bucket, not for the longest context of the batch. All rows use one consistent
        weights version. With `slots` (one per context, below `episodes`, distinct), each
        episode's keys and values stay on the device between turns: a context that extends what
        its slot holds by at most the smallest bucket computes only its new tokens (one more
        width per length bucket to compile; a longer extension is computed whole, from the
        start of the slot). Earlier turns' keys and values are then those of the weights that
        computed them, as in PipelineRL's in-flight weight updates; the log-probs returned are
        still those of the distribution each token was drawn from.

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
        starts = [0] * len(contexts) if slots is None else [
            self._kept_prefix(slot, context) for slot, context in zip(slots, contexts)]
        by_shape: dict[tuple[int | None, int], list[int]] = {}
        for i, (context, start) in enumerate(zip(contexts, starts)):
            total = bucket_for(len(context) + s.max_new_tokens, self.buckets)
            whole = slots is not None and len(context) - start > self.buckets[0]
            if whole:
                starts[i] = 0
            by_shape.setdefault(self._shape(total, slots is not None, whole), []).append(i)
        out_tokens: list[np.ndarray] = [None] * len(contexts)
        out_logps: list[np.ndarray] = [None] * len(contexts)
        for (span, width), rows in by_shape.items():
            tokens, logps = self._generate_rows(
                params, [contexts[i][starts[i]:] for i in rows], [starts[i] for i in rows],
                None if slots is None else [slots[i] for i in rows], span, width, greedy)
            for i, t, lp in zip(rows, tokens, logps):
                out_tokens[i], out_logps[i] = t, lp
        if slots is not None:  # a slot holds every token fed through the model
            for slot, context, t in zip(slots, contexts, out_tokens):
                self._kept[slot] = np.concatenate([np.asarray(context, np.int32), t[:-1]])
        return out_tokens, out_logps, version

    def _shape(self, total: int, kept: bool, whole: bool) -> tuple[int | None, int]:
        """(span, width) of a call in length bucket `total`. Without kept caches: no span, the
        prompt's width. With them: the slots attended to, and the new tokens' width, the
        smallest bucket, or (`whole`: more new tokens than that) the whole context afresh."""
        if not kept:
            return None, total - self.settings.max_new_tokens
        return total, total if whole else self.buckets[0]

    def _kept_prefix(self, slot: int, context: Sequence[int]) -> int:
        """How many of the context's leading tokens slot `slot` holds (at least one is left new)."""
        kept = self._kept[slot]
        n = 0 if kept is None else min(len(kept), len(context) - 1)
        return n if n and np.array_equal(kept[:n], np.asarray(context[:n])) else 0

    def _generate_rows(self, params, news, starts, slots, span: int | None, width: int,
                       greedy: bool):
        """One shape's rows, in calls of batch-ladder sizes (`split_rows`: little padding; `_plan`
        where programs are still compiling), all dispatched before their results are fetched."""
        s = self.settings
        if slots is not None:
            self._make_pool(params)
        results, done = [], 0
        for rows, call_span, call_width in self._plan(params, len(news), span, width, greedy):
            chunk = news[done:done + rows]
            tokens_bw = np.full((rows, call_width), s.pad_id, np.int32)
            valid_bw = np.zeros((rows, call_width), bool)
            for i, new in enumerate(chunk):
                tokens_bw[i, call_width - len(new):] = new
                valid_bw[i, call_width - len(new):] = True
            valid_bw[len(chunk):, -1] = True  # padding rows see one token: none attends to nothing
            start_b = np.zeros(rows, np.int32)
            start_b[:len(chunk)] = starts[done:done + len(chunk)]
            slot_b = None
            if slots is not None:
                slot_b = np.full(rows, self.episodes, np.int32)  # padding rows share a spare slot
                slot_b[:len(chunk)] = slots[done:done + len(chunk)]
            args = self._args(params, tokens_bw, valid_bw, start_b, slot_b)
            program = self._programs[(greedy, call_span, rows, call_width)]
            if slots is None:
                tokens_bg, logps_bg, lengths_b, self._rng, _ = program(*args)
            else:
                tokens_bg, logps_bg, lengths_b, self._rng, self._pool = program(*args)
            results.append((len(chunk), tokens_bg, logps_bg, lengths_b))
            done += len(chunk)
        # Deliberate device->host sync: the actor needs the tokens to step the environments.
        results = jax.device_get(results)
        tokens, logps = [], []
        for n, tokens_bg, logps_bg, lengths_b in results:
            tokens.extend(tokens_bg[i, :lengths_b[i]] for i in range(n))
            logps.extend(logps_bg[i, :lengths_b[i]] for i in range(n))
        return tokens, logps

    def _make_pool(self, params) -> None:
        """The kept caches' device pool, on first use."""
        if self._pool is None:
            model = params_lib.merge(self._graphdef, params)
            self._pool = model.init_cache(self.episodes + 1, self.buckets[-1])  # +1: padding's
            self._pool_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                             self._pool)

    def precompile(self, greedy: bool = False) -> int:
        """Compiles every program a call can use: each length bucket (with kept caches, both the
        continuing width and the whole context) at each row count of the batch ladder. Returns
        how many it compiled (those compiled already are skipped)."""
        with self._lock:
            params = self._params
        if params is None:
            raise RuntimeError("Sampler.precompile called before set_params")
        kept, keys = bool(self.episodes), set()
        for total in self.buckets:
            if total <= self.settings.max_new_tokens:
                continue
            for rows in self.batch_sizes:
                for whole in {False, kept}:
                    span, width = self._shape(total, kept, whole)
                    keys.add((greedy, span, rows, width))
        if self.episodes:
            self._make_pool(params)
        before = self.compiles
        for key in sorted(keys, key=lambda k: (k[1] or 0, k[2], k[3])):
            if key not in self._programs:
                self._compile(params, key)
        return self.compiles - before

    def _args(self, params, tokens_bw, valid_bw, start_b, slot_b, pool=None) -> tuple:
        """A program's arguments (the kept-cache programs take the pool and the slots first)."""
        s = self.settings
        scalars = (np.float32(s.temperature), np.float32(s.top_p), self._allowed_v, self._stop_v,
                   np.int32(s.pad_id))
        if slot_b is None:
            return (params, tokens_bw, valid_bw, start_b, self._rng, *scalars)
        pool = self._pool if pool is None else pool
        return (params, pool, slot_b, tokens_bw, valid_bw, start_b, self._rng, *scalars)

    def _compile(self, params, key: tuple) -> None:
        """Compiles the program of `key` = (greedy, span, rows, width) from example arguments."""
        greedy, span, rows, width = key
        # The pool by shape only: a call on the sampler thread may have donated (deleted) it.
        pool = None if span is None else self._pool_shapes
        example = self._args(params, np.zeros((rows, width), np.int32),
                             np.ones((rows, width), bool), np.zeros(rows, np.int32),
                             None if span is None else np.zeros(rows, np.int32), pool)
        if span is None:
            self._programs[key] = self._fns[greedy].lower(*example).compile()
        else:
            self._programs[key] = self._pool_fns[greedy].lower(*example, span=span).compile()
        self.compiles += 1

    def _plan(self, params, count: int, span: int | None, width: int,
              greedy: bool) -> list[tuple[int, int | None, int]]:
        """(rows, span, width) of the calls that serve `count` rows of shape (span, width).

        The calls `split_rows` picks, each with its own program; without background compiles a
        missing program compiles here. With them, a missing program is queued for the compiler
        thread and its rows ride meanwhile in compiled programs of the narrowest width (and
        span) that holds them: a wider left padding, or a larger span over masked slots,
        computes the same tokens. Only when no compiled program can hold them does this call
        wait for a compile.
        """
        plan = []
        for rows in split_rows(count, self.batch_sizes):
            key = (greedy, span, rows, width)
            if key in self._programs:
                plan.append((rows, span, width))
                continue
            if self._compiler is None:
                self.inline_compiles += 1
                self._compile(params, key)
                plan.append((rows, span, width))
                continue
            future = self._compiling.get(key)
            if future is None:
                future = self._compiling[key] = self._compiler.submit(self._compile_behind,
                                                                      params, key)
            stand_in = self._stand_in(rows, span, width, greedy)
            if stand_in is None:
                self.inline_compiles += 1
                future.result()  # nothing compiled holds these rows: wait for the compiler
                plan.append((rows, span, width))
            else:
                plan.extend(stand_in)
        return plan

    def _compile_behind(self, params, key: tuple) -> None:
        start = time.perf_counter()
        try:
            if key in self._programs:  # compiled while this one was queued
                return
            self._compile(params, key)
            log.info("sampler program %s compiled in the background in %.1f s", key,
                     time.perf_counter() - start)
        finally:
            self._compiling.pop(key, None)

    def _stand_in(self, count: int, span: int | None, width: int,
                  greedy: bool) -> list[tuple[int, int | None, int]] | None:
        """Calls of compiled programs that hold `count` rows of (span, width), or None."""
        fits = [(s, w) for g, s, _, w in list(self._programs)
                if g == greedy and w >= width and (s is None) == (span is None)
                and (span is None or s >= span)]
        if not fits:
            return None
        call_span, call_width = min(fits, key=lambda sw: (sw[1], sw[0] or 0))
        sizes = sorted(r for g, s, r, w in list(self._programs)
                       if (g, s, w) == (greedy, call_span, call_width))
        calls, left = [], count
        while left > 0:  # the smallest size that holds the rest, else the largest there is
            rows = next((r for r in sizes if r >= left), sizes[-1])
            calls.append((rows, call_span, call_width))
            left -= rows
        return calls

    def close(self) -> None:
        """Drops queued background compiles (one already running finishes)."""
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
