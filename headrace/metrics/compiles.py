"""Counts XLA compilations per jitted function name with JAX's own monitoring hook."""

from __future__ import annotations

import collections
import threading

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_counts: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()
_installed = False


def _listener(event: str, duration: float, **kwargs) -> None:
    if event == _EVENT:
        with _lock:
            _counts[str(kwargs.get("fun_name", "?"))] += 1


def install() -> None:
    """Registers the listener once per process."""
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


def compiles(name_part: str) -> int:
    """Compilations so far of jitted functions whose name contains `name_part`."""
    with _lock:
        return sum(n for fun, n in _counts.items() if name_part in fun)
