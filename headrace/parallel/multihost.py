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

- **One decision.** Every step is a collective, so anything that changes what a process does
  next is decided together: before building each step's batch every process votes (`Peers.vote`)
  whether it is stopping or needs a checkpoint (its pending entries fill `buffer.max_pending`),
  and all act on the union of the votes at the same step boundary.
- **Checkpoints.** Every process joins each save (Orbax writes each array shard from the process
  that owns it); process 0 alone writes the metadata, which holds every process's bookkeeping
  (`Peers.gather_json`): its unacknowledged entries and counters.
"""

from __future__ import annotations

import dataclasses
import json
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
    if config.run.launcher not in ("processes", "ray"):
        raise ConfigError(f"parallel.processes={p}: needs run.launcher=processes or ray (one "
                          "learner process per jax.distributed process)")
    if lc.groups_per_batch % (p * lc.minibatches):
        raise ConfigError(f"learner.groups_per_batch={lc.groups_per_batch}: must divide by "
                          f"parallel.processes x learner.minibatches = {p * lc.minibatches} "
                          "(every process brings its share of every minibatch)")


def initialize(coordinator: str, processes: int, process_id: int) -> None:
    """Joins the job (before any JAX computation), with Gloo collectives on CPU."""
    import jax

    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:  # an older or newer JAX without the option: its default
        pass
    # SIGTERM is the supervisor's "stop" (the worker's handler sets the stop event); JAX's
    # preemption service would take the signal for itself and the learners would never stop.
    jax.config.update("jax_enable_preemption_service", False)
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

    def vote(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag OR-ed over every process (every process must call it at the same point)."""
        return tuple(bool(f) for f in self.gather(np.array(flags, np.int32)).any(axis=0))

    def gather_json(self, value) -> list:
        """Every process's JSON-able `value`, in process order."""
        data = np.frombuffer(json.dumps(value).encode(), np.uint8)
        size = int(self.gather(np.array([data.size])).max())
        padded = np.zeros(size, np.uint8)
        padded[:data.size] = data
        return [json.loads(bytes(row).rstrip(b"\0")) for row in self.gather(padded)]
