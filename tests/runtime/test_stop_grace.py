"""Stopping a run: the grace before SIGKILL covers the learner's step (`processes.stop_grace_s`)."""

import multiprocessing
import signal
import sys
import time
import types

import pytest

from headrace.runtime import processes


def _slow_to_stop(seconds: float, ready) -> None:
    """A child that takes `seconds` to finish its 'step' after SIGTERM, then exits cleanly."""
    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(seconds), sys.exit(0)))
    ready.set()
    while True:
        time.sleep(0.05)


def test_the_grace_is_twice_a_long_step_and_never_below_the_floor():
    assert processes.stop_grace_s({}) == processes.GRACE_S
    assert processes.stop_grace_s({"learner/step_s_p90": 40.0}) == processes.GRACE_S
    assert processes.stop_grace_s({"learner/step_s_p90": 175.0}) == 350.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("grace_s, exitcode", [(20.0, 0), (0.5, -signal.SIGKILL)])
def test_stop_waits_for_the_grace_it_was_given_then_kills(grace_s, exitcode):
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    process = context.Process(target=_slow_to_stop, args=(2.0, ready), name="learner",
                              daemon=True)
    process.start()
    try:
        assert ready.wait(30), "the child never installed its SIGTERM handler"
        supervisor = types.SimpleNamespace(actors=[], learners=[types.SimpleNamespace(
            process=process)], grace_s=grace_s, stopping=False)
        processes.Supervisor.stop(supervisor)
        assert process.exitcode == exitcode
    finally:
        if process.is_alive():
            process.kill()
        process.join(5)
