"""The seam between the actor and what generates its tokens (no JAX).

`BatchedPolicy` and `WeightSync` (`headrace.actor.policy`) talk to an engine through `Engine`;
the JAX `Sampler` satisfies it as it is, and loads versions the actor hands it as arrays
(`set_params`). An engine that reads versions from the weight store itself (the vLLM engine,
whose weights live in another process) is a `StoreLoading` engine: `WeightSync` only tells it
which version to load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

# Per context, either one version for all its tokens (an int: the JAX sampler, which never
# changes weights inside a call) or an int32 array with one version per generated token (an
# engine that installs a version while requests are in flight).
Versions = int | list[np.ndarray]


class Engine(Protocol):
    """Generates tokens with their behaviour log-probs for a batch of token contexts.

    Attributes:
      version: the weights version installed (-1 before the first).
      episodes: how many episodes keep a cache slot between turns (0: none).
      compiles, inline_compiles: programs compiled, and of them those a call waited for.
    """

    version: int
    episodes: int

    @property
    def compiles(self) -> int: ...

    @property
    def inline_compiles(self) -> int: ...

    def generate(self, contexts: Sequence[Sequence[int]], greedy: bool = False,
                 slots: Sequence[int] | None = None
                 ) -> tuple[list[np.ndarray], list[np.ndarray], Versions]:
        """(tokens int32, logprobs float32, versions) per context: the sampled tokens (stop
        token included) and their log-probs under the temperature-scaled, untruncated
        distribution they were drawn from."""

    def release(self, slot: int) -> None:
        """The episode of cache slot `slot` has ended: the next episode there must not reuse
        what it kept (computed by weights older than the next episode's stamp)."""

    def max_context(self) -> int:
        """The longest context a call accepts (longer ones raise `PromptTooLong`)."""

    def precompile(self, greedy: bool = False) -> int:
        """Prepares every shape a call can use; returns how many it prepared."""

    def close(self) -> None:
        """Releases what the engine holds (threads, a server process); idempotent."""


@runtime_checkable
class StoreLoading(Protocol):
    """An engine that reads published versions from the weight store on its own."""

    def load_version(self, version: int) -> None:
        """Installs `version` (blocking until requests generate with it).

        Raises:
          VersionGone: the store no longer holds `version`.
          EngineError: the engine failed or did not answer in time.
        """


class EngineError(RuntimeError):
    """The engine (its server) failed, died or did not answer in time: an actor error."""
