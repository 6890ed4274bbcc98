"""The processes launcher starts its actors beside the learner, before version 0 is published:
their start-up (imports, engine, compiles) overlaps the learner's, and each acts only once version
0 is out (`WeightSync.wait_first`). Started after version 0, as they used to be, an actor's whole
start-up came after the learner's."""

from __future__ import annotations

import pytest

from headrace.config import load
from headrace.runtime import build, processes
from tests.conftest import _require_redis


class _Started(Exception):
    """Raised in place of the actors' start: the order up to it is what the test reads."""


@pytest.mark.timeout(120)
def test_actors_start_beside_the_learner_before_version_0(tmp_path):
    _require_redis()
    config = load("examples/guess_number.yaml", [f"run.dir={tmp_path / 'run'}"])
    events: list = []

    class Starts:
        """A supervisor whose learner never publishes: waiting for version 0 before the actors
        start ends the run ("the learner exited before publishing version 0")."""

        def __init__(self, config, run_dir, url, run_id):
            self.weights = build.make_weights(config, run_dir)

        def start_learner(self) -> None:
            events.append("learner")

        def start_actors(self) -> None:
            events.append(("actors", self.weights.latest_version()))
            raise _Started

        def learner_gone(self) -> str:
            return "a learner that publishes nothing"

        def stop(self) -> None:
            events.append("stopped")

    with pytest.raises(_Started):
        processes.train(config, live=False, make_supervisor=Starts)
    assert events[:2] == ["learner", ("actors", -1)], events
    assert events[2:] and set(events[2:]) == {"stopped"}  # and the run stops what it started


@pytest.mark.timeout(120)
def test_an_actor_failing_before_version_0_ends_the_run_with_its_error(tmp_path):
    """Actors that start before version 0 may crash before it too: the wait for it runs the
    supervisor's check (restarts, and the failure after actor.max_restarts), and a failure ends
    the run as one after version 0 does, with a summary (before, the wait went on until the
    learner published, however long its start)."""
    _require_redis()
    config = load("examples/guess_number.yaml", [f"run.dir={tmp_path / 'run'}"])
    error = "actor-0 exited with code 1: RuntimeError: broken (crashed 6 times in a row)"

    class FailingActor:
        """A learner that never publishes and an actor that fails at the third check."""

        def __init__(self, config, run_dir, url, run_id):
            self.failure, self.restarts, self.grace_s, self.stopping = None, 0, 1.0, False
            self.checks = 0

        def start_learner(self) -> None:
            pass

        def start_actors(self) -> None:
            pass

        def learner_gone(self) -> None:
            return None

        def check(self) -> None:
            self.checks += 1
            if self.checks == 3:
                self.failure = error

        def finished(self) -> bool:
            return False

        def stop(self) -> None:
            self.stopping = True

    summary = processes.train(config, live=False, make_supervisor=FailingActor)
    assert summary["stopped_by"] == "error" and summary["errors"] == [error], summary
    assert summary["steps"] == 0
