"""The processes launcher starts its actors beside the learner, before version 0 is published:
their start-up (imports, engine, compiles) overlaps the learner's, and each acts only once version
0 is out (`WeightSync.wait_first`). Started after version 0, as they used to be, an actor's whole
start-up came after the learner's."""

from __future__ import annotations

import pytest

from headrace.buffer.server import RedisServerError, find_redis_server
from headrace.config import load
from headrace.runtime import build, processes


class _Started(Exception):
    """Raised in place of the actors' start: the order up to it is what the test reads."""


@pytest.mark.timeout(120)
def test_actors_start_beside_the_learner_before_version_0(tmp_path):
    try:
        find_redis_server()
    except RedisServerError as error:
        pytest.skip(str(error))
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
