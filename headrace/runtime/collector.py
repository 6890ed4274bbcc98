"""Python's cyclic collector, tuned for a run's steady state (docs/runtime.md, "Python's cyclic
collector").

Once a run's parts are built, what exists (modules, JAX's caches, the model) leaves the
collector's scans (`gc.freeze`) and young collections come every `YOUNG_THRESHOLD` net
allocations instead of Python's 700. With the defaults the example's learner process spent 7 %
of its CPU and its actor 13 % in the collector, mostly full collections walking ~300,000 objects
of start-up about once a second; after, 0.5 % and 1.4 %, and the learner's cyclic garbage is
still collected (as many objects, the same memory).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

# Net allocations of tracked objects between young collections (Python's default: 700). 50,000
# was measured too: no collection after start-up, and the learner leaked.
YOUNG_THRESHOLD = 10_000

_lock = threading.Lock()
_runs = 0  # runs in this process inside `settled`
_caller: tuple[tuple[int, ...], int] = ((), 0)  # its threshold and frozen objects on entry


def settle() -> None:
    """For a process that is the run's own (a learner or actor process): for good."""
    gc.collect()  # start-up's garbage first: what is frozen is never collected
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])


@contextlib.contextmanager
def settled() -> Iterator[None]:
    """`settle` for the length of a run in its caller's process (the threads launcher: the
    command line's, a benchmark's or a test's); the caller's threshold comes back when the last
    run inside ends (runs may overlap on threads of one process), and what was frozen goes back
    into the collector's scans unless the caller had frozen objects of its own (`gc.unfreeze`
    cannot tell them apart: then all stay frozen)."""
    global _runs, _caller
    with _lock:
        if _runs == 0:
            _caller = gc.get_threshold(), gc.get_freeze_count()
            settle()
        _runs += 1
    try:
        yield
    finally:
        with _lock:
            _runs -= 1
            if _runs == 0:
                threshold, frozen = _caller
                if not frozen:
                    gc.unfreeze()
                gc.set_threshold(*threshold)
