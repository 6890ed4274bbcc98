"""Where the processes launcher pins the learner and the actors (`run.learner_cpus`,
`run.actor_cpus`), and the check that the CPUs named exist for this process.

A pinned learner's CPUs are its own: several learner processes (`parallel.processes`) share
`run.learner_cpus` out, and actors without `run.actor_cpus` get the CPUs the learner leaves (the
audit's model of the actors' cores is the same), shared out among the actor processes
(`actor_share`). XLA:CPU runs a thread per CPU a process may use, so on a small machine an unpinned
learner's and actors' thread pools contend for every core. `run.learner_cpus: auto` gives each
learner process one of the CPUs this process may use, the lowest first, when some are left for the
actors (else none is pinned): the same placement on a machine whose CPU set starts elsewhere than
CPU 0 (a container's, a Slurm job's).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection

from headrace.config import ConfigError, RunConfig


def usable_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity: a container's cpuset, taskset)."""
    return frozenset(os.sched_getaffinity(0))


def learner_set(run: RunConfig, processes: int, usable: Collection[int]) -> tuple[int, ...]:
    """Every learner process's CPUs together: `run.learner_cpus`, or for `auto` the lowest
    `processes` of `usable` when more than that many are usable (else none: not pinned)."""
    if run.learner_cpus != "auto":
        return tuple(run.learner_cpus)
    return tuple(sorted(usable)[:processes]) if len(usable) > processes else ()


def learner_cpus(run: RunConfig, process: int, processes: int,
                 usable: Collection[int]) -> tuple[int, ...]:
    """Learner process `process`'s CPUs of `processes`: every `processes`-th of
    `learner_set` from the `process`-th (at least one each when any); empty: not pinned."""
    return learner_set(run, processes, usable)[process::processes]


def actor_cpus(run: RunConfig, usable: Collection[int], processes: int) -> tuple[int, ...]:
    """The actors' CPUs: `run.actor_cpus`, else those of `usable` the pinned learner processes
    (`processes` of them) leave; empty (not pinned) when the learner is not pinned or leaves
    none."""
    learners = learner_set(run, processes, usable)
    if run.actor_cpus or not learners:
        return tuple(run.actor_cpus)
    return tuple(sorted(set(usable) - set(learners)))


def actor_share(cpus: tuple[int, ...], actor: int, actors: int) -> tuple[int, ...]:
    """Actor process `actor`'s CPUs of the `actors` processes' `cpus`: every `actors`-th from the
    `actor`-th, or one CPU (round robin) when there are more processes than CPUs; empty (not
    pinned) when `cpus` is. Each XLA:CPU pool then has threads for its own CPUs, not for every
    actor's: four actors sharing 12 CPUs would run 48 pool threads."""
    if not cpus:
        return ()
    return cpus[actor::actors] or (cpus[actor % len(cpus)],)


def check(run: RunConfig, keys: tuple[str, ...] = ("learner_cpus", "actor_cpus")) -> None:
    """Refuses CPU ids (of `run.<key>` for each of `keys`) no process here may be pinned to,
    before a process pinned to them fails.

    The kernel is asked, on a thread of its own (pinning a thread pins nothing else): a process
    may be pinned to CPUs outside its own affinity (the utilisation bench narrows the
    supervisor's to leave CPU 0 to the learner), but not outside the container's CPU set.

    Raises:
      ConfigError: the key, the ids and the CPUs this process runs on.
    """
    named = {key: () if getattr(run, key) == "auto" else getattr(run, key) for key in keys}
    wanted = sorted({cpu for cpus in named.values() for cpu in cpus})
    refused: list[int] = []

    def probe() -> None:
        for cpu in wanted:
            try:
                os.sched_setaffinity(0, {cpu})  # 0: this thread
            except (OSError, ValueError, OverflowError):  # EINVAL; an id past the C types
                refused.append(cpu)

    thread = threading.Thread(target=probe, name="cpu-probe")
    thread.start()
    thread.join()
    for key, cpus in named.items():
        missing = sorted(set(cpus) & set(refused))
        if missing:
            raise ConfigError(f"run.{key}={list(cpus)}: CPU {missing} does not exist "
                              f"here or is outside this container's CPU set (headrace runs on CPUs "
                              f"{sorted(usable_cpus())}); name CPUs that exist, [] to leave the "
                              "process unpinned, or (run.learner_cpus) auto")
