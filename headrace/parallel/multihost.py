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


# How long a process waits at a barrier for the others: a program can take minutes to compile for
# a large model (a process that died ends the run sooner, through the supervisor).
COMPILE_BARRIER_S = 1800


class CompiledTogether:
    """A jitted program that every process of the job compiles before any process runs it.

    On CPU, Gloo gives a collective 30 s (fixed) for the other processes to join. A program's
    persistent-cache key differs between the processes there (it holds each process's topology)
    and JAX writes cache entries from process 0 only, so process 0 loads a program from the cache
    in a fraction of a second while the others compile it, which takes longer than that on a
    loaded machine: process 0 then times out in the program's first collective. So on a call
    whose arguments have shapes not seen before, each process compiles first
    (`lower(...).compile()`, which the call then finds in JAX's in-memory cache) and all meet at a
    barrier of the coordination service before any runs it. Every process meets the same new
    shapes in the same order (they agree on every step's shapes, `Peers.agree`), so the barriers
    pair up. (The learner also meets the others at a barrier before its first collective, for the
    programs that built its state, `_init_params` among them.)
    """

    def __init__(self, jitted, name: str, timeout_s: float = COMPILE_BARRIER_S):
        self.jitted = jitted
        self.lower = jitted.lower
        self.name = name
        self.timeout_s = timeout_s
        self._seen: set = set()

    def __call__(self, *args):
        import jax

        # The first argument (the carried train state) keeps its shapes: the key is the rest's.
        shapes = tuple((np.shape(x), str(getattr(x, "dtype", type(x))))
                       for x in jax.tree.leaves(args[1:]))
        if shapes not in self._seen:
            self.jitted.lower(*args).compile()
            barrier(f"{self.name}-compiled-{len(self._seen)}", self.timeout_s)
            self._seen.add(shapes)
        return self.jitted(*args)


def barrier(name: str, timeout_s: float) -> None:
    """Waits until every process of the job reaches the barrier `name` (the coordination
    service's, not a collective: no Gloo timeout applies)."""
    from jax._src import distributed  # the job's client: no public handle to its barrier

    distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))
