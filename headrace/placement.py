"""Where the processes launcher pins the learner and the actors (`run.learner_cpus`,
`run.actor_cpus`), and the check that the CPUs named exist for this process.

A pinned learner's CPUs are its own: several learner processes (`parallel.processes`) share
`run.learner_cpus` out, and actors without `run.actor_cpus` get the CPUs the learner leaves (the
audit's model of the actors' cores is the same). XLA:CPU runs a thread per CPU a process may use,
so on a small machine an unpinned learner's and actors' thread pools contend for every core.
"""

from __future__ import annotations

import os
from collections.abc import Collection

from headrace.config import ConfigError, RunConfig


def usable_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity: a container's cpuset, taskset)."""
    return frozenset(os.sched_getaffinity(0))


def learner_cpus(run: RunConfig, process: int, processes: int) -> tuple[int, ...]:
    """Learner process `process`'s CPUs of `processes`: every `processes`-th of
    `run.learner_cpus` from the `process`-th (the config holds at least one each); empty: not
    pinned."""
    return tuple(run.learner_cpus[process::processes])


def actor_cpus(run: RunConfig, usable: Collection[int]) -> tuple[int, ...]:
    """The actors' CPUs: `run.actor_cpus`, else those of `usable` a pinned learner leaves; empty
    (not pinned) when the learner is not pinned or leaves none."""
    if run.actor_cpus or not run.learner_cpus:
        return tuple(run.actor_cpus)
    return tuple(sorted(set(usable) - set(run.learner_cpus)))


def check(run: RunConfig, keys: tuple[str, ...] = ("learner_cpus", "actor_cpus")) -> None:
    """Refuses CPU ids (of `run.<key>` for each of `keys`) this process may not run on, before a
    process pinned to them fails.

    Raises:
      ConfigError: the key, the ids and the CPUs there are.
    """
    usable = usable_cpus()
    for key in keys:
        cpus = getattr(run, key)
        missing = sorted(set(cpus) - usable)
        if missing:
            raise ConfigError(f"run.{key}={list(cpus)}: this machine lets headrace run on CPUs "
                              f"{sorted(usable)}, not {missing}; name some of those, or [] to "
                              "leave the process unpinned")
