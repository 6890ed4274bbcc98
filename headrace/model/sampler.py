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

The sampler's three jobs live in three modules: the device programs (`headrace.model.decode`),
the kept-cache pool (`headrace.model.kept_cache`) and the compile scheduler, which may compile in
the background while compiled programs serve (`headrace.model.programs`). This module turns
contexts into calls: it groups rows by shape, pads them, and puts each row's tokens back.

Top log-probs. `generate_top(contexts, k)` also returns, per generated token, the k (at most
`TOP_LOGPROBS`) likeliest tokens of the distribution it was drawn from and their log-probs
(computed on the device, `jax.lax.top_k`, in programs of their own: `TOP_LOGPROBS` alternatives
are computed and the first k kept, so one variant serves every k). `generate` never runs those
programs, so it pays nothing for them; a sampler that serves both compiles each shape twice.

Calls are serialised: `generate` and `generate_top` may come from different threads (the actor's
sampler thread, a gateway's), one runs at a time.

Failure modes: a context that cannot fit (`len + max_new_tokens > largest bucket`) raises
`PromptTooLong` before any device work; the caller ends that episode as truncated.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from headrace.model import decode
from headrace.model.decode import Request, Sampling
from headrace.model.kept_cache import KeptCaches
from headrace.model.programs import ProgramKey, Programs
from headrace.shapes import batch_ladder, bucket_for

TOP_LOGPROBS = 20  # alternatives the top-log-probs programs compute per token (OpenAI's most)


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
        self.buckets = tuple(buckets)
        self.batch_sizes = batch_ladder(max_batch)
        self.kept = KeptCaches(graphdef, episodes, self.buckets[-1])
        self._lock = threading.Lock()  # guards (params, version)
        self._calls = threading.Lock()  # one call at a time (the rng, the kept pool)
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
        self._sampling = Sampling(np.float32(settings.temperature), np.float32(settings.top_p),
                                  jnp.asarray(allowed), jnp.asarray(stop),
                                  np.int32(settings.pad_id))
        self._fns, self._pool_fns = {}, {}
        for greedy, top in itertools.product((False, True), (0, TOP_LOGPROBS)):
            static = dict(max_new=settings.max_new_tokens, top_k=settings.top_k,
                          use_top_p=settings.top_p < 1.0, greedy=greedy, top=top)
            self._fns[greedy, top] = jax.jit(functools.partial(decode.generate, graphdef,
                                                               **static))
            self._pool_fns[greedy, top] = jax.jit(
                functools.partial(decode.generate_in_pool, graphdef, **static),
                static_argnames=("span",), donate_argnums=(1,))
        self.programs = Programs(self._compile, self.batch_sizes, background_compiles)

    @property
    def compiles(self) -> int:
        """Programs compiled."""
        return self.programs.compiles

    @property
    def inline_compiles(self) -> int:
        """Of them, those a call waited for."""
        return self.programs.inline_compiles

    def set_params(self, params, version: int) -> None:
        with self._lock:
            self._params, self.version = params, version

    def release(self, slot: int) -> None:
        """The episode of kept-cache slot `slot` has ended (`KeptCaches.forget`). Its calls have
        returned by then, so nothing races this, unless it was cancelled mid-call: that happens
        only when the actor stops (`Actor.run`), and no episode follows."""
        self.kept.forget(slot)

    def max_context(self) -> int:
        return self.buckets[-1] - self.settings.max_new_tokens

    def generate(self, contexts: Sequence[Sequence[int]], greedy: bool = False,
                 slots: Sequence[int] | None = None):
        """Returns (tokens, logprobs, version): per context an int32 and a float32 array.

        Contexts are grouped by length bucket and each group runs as its own call, so a row pays
        for its own bucket, not for the longest context of the batch. All rows use one consistent
        weights version. With `slots` (one per context, below `episodes`, distinct), each
        episode's keys and values stay on the device between turns (`KeptCaches`): a context
        that extends what its slot holds by at most the smallest bucket computes only its new
        tokens (one more width per length bucket to compile; a longer extension is computed
        whole, from the start of the slot). The log-probs returned are those of the
        distribution each token was drawn from.

        Raises:
          PromptTooLong: some context is longer than `max_context()`.
          ValueError: more contexts than `max_batch`.
        """
        tokens, logps, _, version = self._generate(contexts, greedy, slots, 0)
        return tokens, logps, version

    def generate_top(self, contexts: Sequence[Sequence[int]], k: int, greedy: bool = False,
                     slots: Sequence[int] | None = None):
        """`generate`, with each generated token's k likeliest alternatives.

        Returns (tokens, logprobs, tops, version): tokens and logprobs as `generate`'s; per
        context, tops is (ids int32[n, k], log-probs float32[n, k]) for its n tokens, most likely
        first, under the distribution each token was drawn from (temperature-scaled, untruncated,
        restricted to the allowed tokens: the one its log-prob is of).

        Raises:
          ValueError: k outside 1..TOP_LOGPROBS; as `generate` otherwise.
        """
        if not 1 <= k <= TOP_LOGPROBS:
            raise ValueError(f"k={k}: top log-probs are served for 1 to {TOP_LOGPROBS} tokens")
        tokens, logps, tops, version = self._generate(contexts, greedy, slots, TOP_LOGPROBS)
        return tokens, logps, [(ids[:, :k], lps[:, :k]) for ids, lps in tops], version

    def _generate(self, contexts, greedy, slots, top):
        with self._calls:
            return self._generate_serialised(contexts, greedy, slots, top)

    def _generate_serialised(self, contexts, greedy, slots, top):
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
            self.kept.prefix(slot, context) for slot, context in zip(slots, contexts)]
        by_shape: dict[tuple[int | None, int], list[int]] = {}
        for i, (context, start) in enumerate(zip(contexts, starts)):
            total = bucket_for(len(context) + s.max_new_tokens, self.buckets)
            whole = slots is not None and len(context) - start > self.buckets[0]
            if whole:
                starts[i] = 0
            by_shape.setdefault(self._shape(total, slots is not None, whole), []).append(i)
        out_tokens: list[np.ndarray] = [None] * len(contexts)
        out_logps: list[np.ndarray] = [None] * len(contexts)
        out_tops: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(contexts)
        for (span, width), rows in by_shape.items():
            tokens, logps, tops = self._generate_rows(
                params, [contexts[i][starts[i]:] for i in rows], [starts[i] for i in rows],
                None if slots is None else [slots[i] for i in rows], span, width, greedy, top)
            for i, t, lp, tp in zip(rows, tokens, logps, tops):
                out_tokens[i], out_logps[i], out_tops[i] = t, lp, tp
        if slots is not None:
            self.kept.remember(slots, contexts, out_tokens)
        return out_tokens, out_logps, out_tops, version

    def _shape(self, total: int, kept: bool, whole: bool) -> tuple[int | None, int]:
        """(span, width) of a call in length bucket `total`. Without kept caches: no span, the
        prompt's width. With them: the slots attended to, and the new tokens' width, the
        smallest bucket, or (`whole`: more new tokens than that) the whole context afresh."""
        if not kept:
            return None, total - self.settings.max_new_tokens
        return total, total if whole else self.buckets[0]

    def _request(self, news: Sequence[Sequence[int]], starts: Sequence[int], rows: int,
                 width: int) -> Request:
        """`rows` x `width` of new tokens, right-aligned; rows past `news` are padding."""
        lengths = np.fromiter(map(len, news), np.int64, len(news))
        valid_bw = np.zeros((rows, width), bool)
        valid_bw[:len(news)] = np.arange(width) >= width - lengths[:, None]
        tokens_bw = np.full((rows, width), self.settings.pad_id, np.int32)
        # Row-major order of the valid cells is each row's tokens in order: one assignment.
        tokens_bw[valid_bw] = np.fromiter(itertools.chain.from_iterable(news), np.int32,
                                          int(lengths.sum()))
        valid_bw[len(news):, -1] = True  # padding rows see one token: none attends to nothing
        start_b = np.zeros(rows, np.int32)
        start_b[:len(news)] = starts
        return Request(tokens_bw, valid_bw, start_b)

    def _generate_rows(self, params, news, starts, slots, span: int | None, width: int,
                       greedy: bool, top: int):
        """One shape's rows, in calls of batch-ladder sizes (`Programs.plan`), all dispatched
        before their results are fetched."""
        if slots is not None:
            self.kept.ensure(params)
        results, done = [], 0
        for key in self.programs.plan(params, len(news), span, width, greedy, top):
            n = min(key.rows, len(news) - done)
            request = self._request(news[done:done + n], starts[done:done + n], key.rows,
                                    key.width)
            program = self.programs[key]
            if slots is None:
                decoded, self._rng, _ = program(params, request, self._sampling, self._rng)
            else:
                slot_b = self.kept.slot_b(slots[done:done + n], key.rows)
                decoded, self._rng, self.kept.pool = program(
                    params, self.kept.pool, slot_b, request, self._sampling, self._rng)
            results.append((n, decoded))
            done += n
        # Deliberate device->host sync: the actor needs the tokens to step the environments.
        results = jax.device_get(results)
        tokens, logps, tops = [], [], []
        for n, d in results:
            lengths_b = d.lengths_b
            tokens.extend(d.tokens_bg[i, :lengths_b[i]] for i in range(n))
            logps.extend(d.logps_bg[i, :lengths_b[i]] for i in range(n))
            tops.extend((d.top_ids_bgk[i, :lengths_b[i]], d.top_logps_bgk[i, :lengths_b[i]])
                        if top else None for i in range(n))
        return tokens, logps, tops

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
                    keys.add(ProgramKey(greedy, span, rows, width))
        if self.episodes:
            self.kept.ensure(params)
        before = self.compiles
        for key in sorted(keys, key=lambda k: (k.span or 0, k.rows, k.width)):
            if key not in self.programs.compiled:
                self.programs.compile(params, key)
        return self.compiles - before

    def _compile(self, params, key: ProgramKey):
        """The compiled program of `key`, lowered on example arguments of its shape."""
        request = Request(np.zeros((key.rows, key.width), np.int32),
                          np.ones((key.rows, key.width), bool), np.zeros(key.rows, np.int32))
        if key.span is None:
            return self._fns[key.greedy, key.top].lower(params, request, self._sampling,
                                                        self._rng).compile()
        # The pool by shape only: a call on the sampler thread may have donated (deleted) it.
        return self._pool_fns[key.greedy, key.top].lower(
            params, self.kept.shapes, np.zeros(key.rows, np.int32), request, self._sampling,
            self._rng, span=key.span).compile()

    def close(self) -> None:
        """Drops queued background compiles (one already running finishes)."""
        self.programs.close()
