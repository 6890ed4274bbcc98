"""Where an actor process's CPU goes: its turns (the event loop and its worker threads) or the
rest (the sampler's calls: its thread and XLA's), for the audit's CPU model.

Per-thread CPU is read from /proc (Linux); elsewhere only the calling thread's is known.
"""

from __future__ import annotations

import os
import threading
import time

# /proc counts a thread's CPU in clock ticks, each charged to the thread running when it fires:
# a reading of a few ticks is noise.
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _thread_cpu_s(native_id: int) -> float | None:
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:  # the thread ended, or no /proc
        return None
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime


class TurnCpu:
    """Cumulative CPU seconds of the event loop's thread (the calling thread, else `loop_thread`:
    a native thread id) and of the threads whose names start with `prefix` (its executor:
    environment steps, buffer puts)."""

    def __init__(self, prefix: str, loop_thread: int | None = None):
        self.prefix = prefix
        self._own = loop_thread is None  # without /proc only the calling thread's is known
        self._main = threading.get_native_id() if self._own else loop_thread
        self._seen: dict[int, float] = {}  # native id -> CPU seconds at the last read
        self.total_s = 0.0

    def read(self) -> float:
        """CPU seconds the turn-side threads used so far (from one thread at a time)."""
        ids = [self._main] + [t.native_id for t in threading.enumerate()
                              if t.name.startswith(self.prefix) and t.native_id is not None]
        for native_id in ids:
            now = _thread_cpu_s(native_id)
            if now is None:
                if native_id == self._main and self._own:  # no /proc: this thread's clock
                    now = time.thread_time()
                else:
                    continue
            self.total_s += now - self._seen.get(native_id, 0.0)
            self._seen[native_id] = now
        return self.total_s
