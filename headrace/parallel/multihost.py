"""Multi-host learners: `parallel.processes` learner processes joined by `jax.distributed`.

Each learner process is one consumer of the buffer and brings `groups_per_batch / processes`
groups to every step; together they train one global batch on one mesh spanning every process's
devices. For that every process must run the same program on consistent data:

- **Same shapes.** Each process packs its own groups (`Batcher`), then `Peers.agree` allgathers
  every process's microbatch shapes and all take, per minibatch and position (widest first), the
  elementwise largest rows and width. A process pads its microbatches to those shapes and adds
  all-padding ones where it has fewer: every process derives the same shape list from the same
  gathered numbers, so the program is the same everywhere (padding has weight 0).
- **Same objective.** Token weights are normalised over the global minibatch: `Peers.total`
  sums every process's loss-token and trajectory counts before the weights are filled.
- **One writer.** Process 0 publishes weights (`host_params` gathers the sharded parameters on
  every process: a collective all must join) and writes traces; every process reports its own
  queue to admission control (`learner_update(host=...)`).

Lockstep: every step is a collective, so the processes stop together only on the shared
conditions (`run.max_steps`, the supervisor stopping them all). Checkpoints are not yet
multi-process (`check`).
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Sequence

import numpy as np

from headrace.config import Config, ConfigError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check(config: Config) -> None:
    """What a multi-process learner needs of the config.

    Raises:
      ConfigError: naming the key and the fix.
    """
    p = config.parallel.processes
    if p == 1:
        return
    lc = config.learner
    if config.run.launcher != "processes":
        raise ConfigError(f"parallel.processes={p}: needs run.launcher=processes (one learner "
                          "process per jax.distributed process)")
    if lc.groups_per_batch % (p * lc.minibatches):
        raise ConfigError(f"learner.groups_per_batch={lc.groups_per_batch}: must divide by "
                          f"parallel.processes x learner.minibatches = {p * lc.minibatches} "
                          "(every process brings its share of every minibatch)")
    if config.run.checkpoint_every:
        raise ConfigError(f"run.checkpoint_every={config.run.checkpoint_every}: checkpoints of "
                          f"a multi-process learner (parallel.processes={p}) are not built yet; "
                          "set it to 0")


def initialize(coordinator: str, processes: int, process_id: int) -> None:
    """Joins the job (before any JAX computation), with Gloo collectives on CPU."""
    import jax

    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:  # an older or newer JAX without the option: its default
        pass
    jax.distributed.initialize(coordinator, processes, process_id)


def allgather(values: np.ndarray) -> np.ndarray:
    """[processes, *values.shape]: every process's `values` (the same shape everywhere)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(values)))


def host_params(params):
    """The (sharded, multi-process) parameters as host NumPy on every process (a collective)."""
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(params, tiled=True)


@dataclasses.dataclass
class Peers:
    """The other learner processes, as the batcher sees them (`gather` is `allgather` in a job;
    tests pass their own)."""

    gather: callable = allgather

    def total(self, counts: np.ndarray) -> np.ndarray:
        """`counts` summed over every process."""
        return self.gather(counts).sum(axis=0)

    def agree(self, shapes: Sequence[Sequence[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
        """Per minibatch, the microbatch shapes every process will use.

        `shapes[m]` are this process's (rows, width) in minibatch m. The agreed list has, per
        minibatch, as many microbatches as the process with most, and at position j the largest
        rows and width of position j over the processes (each sorted widest first, so like sizes
        meet). Every process computes the same answer from the same gathered numbers.
        """
        m = len(shapes)
        local = [sorted(s, key=lambda rw: (rw[1], rw[0]), reverse=True) for s in shapes]
        count = int(self.gather(np.array([len(s) for s in local] or [0])).max()) if m else 0
        table = np.zeros((m, max(count, 1), 2), np.int64)
        for i, s in enumerate(local):
            for j, (rows, width) in enumerate(s):
                table[i, j] = rows, width
        agreed = self.gather(table).max(axis=0)
        return [[(int(r), int(w)) for r, w in row if r and w] for row in agreed]
