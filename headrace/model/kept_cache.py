"""The kept-cache pool: each episode's keys and values stay on the device between its turns.

Slot k (0 <= k < episodes) holds the keys and values of the tokens episode k fed through the
model so far, and `prefix` says how many of a new context's leading tokens it holds, so a turn
computes only its new tokens; `forget` empties a slot when its episode ends. One more slot,
`spare`, takes padding rows. The pool is made on first use (`ensure`) and donated to every call
that uses it (`pool` is then the call's result). Earlier turns' keys and values are those of the
weights that computed them, as in PipelineRL's in-flight weight updates.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from headrace.model import params as params_lib
from headrace.model.transformer import KVCache
from headrace.types import as_ints


class KeptCaches:
    def __init__(self, graphdef, episodes: int, slots: int):
        """`episodes` kept caches of `slots` positions each (the largest length bucket)."""
        self.episodes = episodes
        self.spare = episodes  # the slot padding rows share
        self._graphdef = graphdef
        self._slots = slots
        self.pool: KVCache | None = None  # per layer (keys, values) [episodes + 1, slots, g, e]
        self.shapes = None  # the pool's shapes and dtypes (for compiling without it)
        # What each slot holds, as Python ints: a list compares and copies in C, where a small
        # array pays NumPy's per-call overhead several times per row (a few thousand rows a second)
        self._tokens: list[list[int] | None] = [None] * episodes

    def ensure(self, params) -> None:
        """Makes the pool on first use."""
        if self.pool is None:
            model = params_lib.merge(self._graphdef, params)
            self.pool = model.init_cache(self.episodes + 1, self._slots)
            self.shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                       self.pool)

    def prefix(self, slot: int, context: Sequence[int]) -> int:
        """How many of the context's leading tokens slot `slot` holds (at least one is left new)."""
        kept = self._tokens[slot]
        n = 0 if kept is None else min(len(kept), len(context) - 1)
        return n if n and kept[:n] == as_ints(context[:n]) else 0

    def remember(self, slots: Sequence[int], contexts: Sequence[Sequence[int]],
                 generated: Sequence[np.ndarray]) -> None:
        """Notes what each slot now holds: every token fed through the model (the context, and
        the generated tokens but the last, which was sampled, not fed)."""
        for slot, context, tokens in zip(slots, contexts, generated):
            self._tokens[slot] = as_ints(context) + as_ints(tokens[:-1])

    def forget(self, slot: int) -> None:
        """Slot `slot`'s episode has ended: the next episode there computes its context afresh.
        Kept keys and values are of the weights that computed them, which is right within one
        episode only; a new episode whose first context starts as the last one did (a fixed
        task prompt) would otherwise attend to an older policy's keys and values while its
        log-probs are stamped with the current version."""
        self._tokens[slot] = None

    def slot_b(self, slots: Sequence[int], rows: int) -> np.ndarray:
        """i32[rows]: the slots of a call's rows; padding rows take the spare slot."""
        slot_b = np.full(rows, self.spare, np.int32)
        slot_b[:len(slots)] = slots
        return slot_b
