"""XLA flags headrace sets for every process it runs (before JAX starts its backend)."""

from __future__ import annotations

import os

CPU_MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def use_cpu_memory_scheduler() -> None:
    """XLA:CPU's default, concurrency-optimised (breadth-first) scheduler runs a rematerialised
    block's recomputation early, so `model.remat: block` kept about as many bytes as `none`; its
    depth-first memory scheduler keeps remat's saving (docs/models.md, Remat). Asked for unless
    XLA_FLAGS already names the flag; through the environment, so the processes a run spawns
    inherit it. XLA:GPU and TPU ignore it. No effect once this process's backend has started."""
    os.environ["XLA_FLAGS"] = with_cpu_memory_scheduler(os.environ.get("XLA_FLAGS", ""))


def with_cpu_memory_scheduler(flags: str) -> str:
    """`flags` (an XLA_FLAGS value) asking for the memory scheduler, unless they name it."""
    if "xla_cpu_enable_concurrency_optimized_scheduler" in flags:
        return flags
    return f"{flags} {CPU_MEMORY_SCHEDULER}".strip()
