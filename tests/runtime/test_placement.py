"""Where the processes launcher pins the learner and the actors (`headrace.placement`)."""

import os
import subprocess
import sys
import threading

import pytest

from headrace import benchlib, placement
from headrace.audit import audit
from headrace.config import ConfigError, load
from headrace.runtime import processes

EXAMPLE = str(benchlib.EXAMPLES / "guess_number.yaml")


def _pinned(monkeypatch, tmp_path, usable, **sections):
    """(each learner process's CPUs, each actor's) as a Supervisor hands them to its children,
    on a machine whose usable CPUs are `usable` (nothing is started)."""
    monkeypatch.setattr(placement, "usable_cpus", lambda: frozenset(usable))
    config = load(EXAMPLE, overrides=[f"{section}.{key}={value}" for section, values
                                      in sections.items() for key, value in values.items()])
    supervisor = processes.Supervisor(config, tmp_path, "redis://127.0.0.1:1/0", "test")
    learners = [child.args[4] for child in supervisor.learners]
    return learners, [child.args[5] for child in supervisor.actors]


@pytest.mark.parametrize("run, parallel, learners, actors", [
    ({"learner_cpus": "[0]"}, {}, [(0,)], [(1, 2, 3)]),  # a pinned learner's core is its own
    ({"learner_cpus": "[]"}, {}, [()], [()]),  # nothing pinned
    ({"learner_cpus": "[0]", "actor_cpus": "[0, 3]"}, {}, [(0,)], [(0, 3)]),  # as given
    ({"learner_cpus": "[0, 1, 2, 3]"}, {}, [(0, 1, 2, 3)], [()]),  # none left: anywhere
    ({"learner_cpus": "[0, 1, 2]"}, {"processes": 2, "mesh": "{data: -1}"},
     [(0, 2), (1,)], [(3,)]),  # several learner processes share the list out
])
def test_the_supervisor_pins_children_where_the_placement_says(monkeypatch, tmp_path, run,
                                                               parallel, learners, actors):
    assert _pinned(monkeypatch, tmp_path, {0, 1, 2, 3}, run=run, parallel=parallel) == (
        learners, actors)


@pytest.mark.parametrize("usable, processes, learners, actors", [
    ({0, 1}, 1, [(0,)], [(1,)]),  # the example on a machine of two cores
    ({6, 7, 9}, 1, [(6,)], [(7, 9)]),  # a CPU set without CPU 0: the lowest it has
    ({4, 5, 6}, 2, [(4,), (5,)], [(6,)]),  # one each
    ({3}, 1, [()], [()]),  # one CPU: nothing is pinned
    ({2, 3}, 2, [(), ()], [()]),  # none would be left for the actors: nothing is pinned
])
def test_auto_pins_each_learner_process_to_a_usable_cpu_when_some_are_left(
        monkeypatch, tmp_path, usable, processes, learners, actors):
    parallel = {"processes": processes, "mesh": "{data: -1}"} if processes > 1 else {}
    assert load(EXAMPLE).run.learner_cpus == "auto"  # the example ships with it
    assert _pinned(monkeypatch, tmp_path, usable, run={"learner_cpus": "auto"},
                   parallel=parallel) == (learners, actors)
    config = load(EXAMPLE, overrides=[f"parallel.{k}={v}" for k, v in parallel.items()])
    assert audit.actor_cores(config) == (len(actors[0]) or len(usable))  # the audit agrees


@pytest.mark.parametrize("num_actors, actors", [
    (2, [(1, 3), (2,)]),  # every 2nd each
    (3, [(1,), (2,), (3,)]),
    (5, [(1,), (2,), (3,), (1,), (2,)]),  # more processes than CPUs: one each, round robin
])
def test_actor_processes_share_the_actors_cpus_out(monkeypatch, tmp_path, num_actors, actors):
    assert _pinned(monkeypatch, tmp_path, {0, 1, 2, 3}, run={"learner_cpus": "[0]"},
                   actor={"num_actors": num_actors}) == ([(0,)], actors)
    assert _pinned(monkeypatch, tmp_path, {0, 1, 2, 3}, run={"learner_cpus": "[]"},
                   actor={"num_actors": num_actors}) == ([()], [()] * num_actors)


def test_several_learner_processes_need_a_cpu_each_and_ids_are_not_negative():
    with pytest.raises(ConfigError, match="run.learner_cpus.*at least 2"):
        load(EXAMPLE, overrides=["parallel.processes=2", "run.learner_cpus=[0]"])
    with pytest.raises(ConfigError, match="run.actor_cpus.*>= 0"):
        load(EXAMPLE, overrides=["run.actor_cpus=[1, -1]"])
    with pytest.raises(ConfigError, match="must be a list of integers or one of auto"):
        load(EXAMPLE, overrides=["run.learner_cpus=all"])


def test_a_narrowed_supervisor_may_still_pin_a_learner_outside_its_own_cpus():
    """The utilisation bench narrows its own process to leave CPU 0 to the learner: the check
    asks the kernel what a child may be pinned to, not what the checking process runs on."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    config = load(EXAMPLE, overrides=[f"run.learner_cpus=[{cpus[0]}]"])
    errors: list[Exception] = []

    def narrowed() -> None:
        os.sched_setaffinity(0, {cpus[1]})  # this thread only, as the bench narrows itself
        try:
            placement.check(config.run)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    thread = threading.Thread(target=narrowed)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and not errors


def _refused(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "headrace.cli", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.timeout(150)
def test_cpus_the_machine_lacks_are_refused_before_anything_starts(tmp_path):
    absent = 4000  # past any machine of this kind's CPUs (and its container's CPU set)
    run_dir = tmp_path / "run"
    learner = _refused("train", EXAMPLE, "--set", f"run.learner_cpus=[{absent}]", "--set",
                       f"run.dir={run_dir}")
    assert learner.returncode == 2 and f"run.learner_cpus=[{absent}]" in learner.stderr
    assert "Traceback" not in learner.stderr and not run_dir.exists()
    actor = _refused("actor", EXAMPLE, "--connect", "redis://127.0.0.1:1/0", "--set",
                     f"run.actor_cpus=[{absent}]")  # refused before it tries the address
    assert actor.returncode == 2 and f"run.actor_cpus=[{absent}]" in actor.stderr
    assert "Traceback" not in actor.stderr
