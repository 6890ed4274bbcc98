"""The quick-bench tests' runner explains a timeout: the failure carries every thread's stack of
the command it ran, and nothing of the command outlives it."""

import pathlib

import pytest

from headrace.benchmarks.chaos import dump_stacks, members
from tests.e2e.benchrun import run_headrace

CONFIG = str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "guess_number.yaml")


@pytest.mark.timeout(120)
def test_a_command_past_its_time_fails_with_its_stacks(redis_server_factory, monkeypatch):
    server = redis_server_factory().start()  # no learner announces a run there: the actor waits
    started = []

    def recording(pgid: int) -> None:
        started.append(pgid)
        dump_stacks(pgid)

    monkeypatch.setattr("tests.e2e.benchrun.dump_stacks", recording)
    with pytest.raises(pytest.fail.Exception) as failure:
        run_headrace(["actor", CONFIG, "--connect", server.url, "--wait", "90", "--name", "slow"],
                     timeout_s=20)
    message = str(failure.value)
    assert "did not finish in 20 s" in message
    assert "(most recent call first)" in message, message  # faulthandler's stack
    assert "in _wait_for_run" in message, message  # where the actor was waiting
    assert started and not members(started[0])  # the whole group is gone
