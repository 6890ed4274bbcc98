"""The watch loop's clocks: `run.max_train_s` counts from the first trained step, so start-up
(spawning, compiling, the first batch) is not part of the training window."""

import os
import signal
import time

import pytest

from headrace.config import ConfigError, load
from headrace.metrics.core import Metrics
from headrace.runtime import build, supervise
from headrace.weights.memory import MemoryWeightStore


def _config(tmp_path, **run):
    return load(data={"env": {"name": "guess_number", "kwargs": {"n": 8, "max_turns": 3}},
                      "model": {"preset": "tiny", "max_len": 32},
                      "sampling": {"max_new_tokens": 1, "constrain_to_actions": True},
                      "shapes": {"buckets": [8]},
                      "run": {"dir": str(tmp_path), "eval_every": 0, "log_every": 1, **run}})


@pytest.mark.timeout(60)
def test_max_train_s_counts_from_the_first_trained_step(tmp_path):
    config = _config(tmp_path, max_train_s=1.5, max_wall_s=30.0)
    task = build.build_task(config)
    graphdef, _ = build.init_params(config, task)
    t0 = time.time()
    evaluator = supervise.Evaluator(config, task, graphdef, MemoryWeightStore(keep=2), Metrics(),
                                    t0, lambda: 0.0)
    first_step_at = t0 + 2.0  # start-up longer than the training window

    def snapshot():
        return {"learner/step": 0 if time.time() < first_step_at else 1 + time.time() - t0}

    reporter = supervise.Reporter(config, tmp_path, live=False)
    stopped_by = supervise.watch(config, t0, snapshot=snapshot, reporter=reporter,
                                 evaluator=evaluator, failed=lambda: False, finished=lambda: False)
    reporter.close()
    stopped_at = time.time()
    assert stopped_by == "max_train_s"
    # Polled every half second; 10 s of slack for a loaded machine (counting from t0 instead
    # would stop 0.5 s before the first step, which the lower bound catches).
    assert 1.5 <= stopped_at - first_step_at <= 1.5 + 10
    assert stopped_at - t0 >= 3.5


def _watch(config, tmp_path, tick, snapshot=lambda: {"learner/step": 0}):
    task = build.build_task(config)
    graphdef, _ = build.init_params(config, task)
    evaluator = supervise.Evaluator(config, task, graphdef, MemoryWeightStore(keep=2), Metrics(),
                                    time.time(), lambda: 0.0)
    reporter = supervise.Reporter(config, tmp_path, live=False)
    try:
        return supervise.watch(config, time.time(), snapshot=snapshot, reporter=reporter,
                               evaluator=evaluator, failed=lambda: False,
                               finished=lambda: False, tick=tick)
    finally:
        reporter.close()


@pytest.mark.timeout(60)
def test_ctrl_c_stops_the_run_at_the_next_tick_without_cutting_into_the_current_one(tmp_path):
    """The supervisor's tick starts children and talks to Redis; a KeyboardInterrupt raised in
    the middle would leave a child started but not recorded (never stopped: the exit hangs
    joining it). Ctrl-C is read between ticks instead, and the handler is put back after."""
    config = _config(tmp_path, max_wall_s=30.0)
    ticks = []

    def tick():
        ticks.append("begun")
        if ticks.count("begun") == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C lands inside this tick
            time.sleep(0.2)  # the handler runs here, in the main thread
        ticks.append("done")

    before = signal.getsignal(signal.SIGINT)
    assert _watch(config, tmp_path, tick) == "interrupted"
    assert ticks == ["begun", "done", "begun", "done"]  # the tick ran to its end; no third
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.timeout(60)
def test_a_second_ctrl_c_interrupts_at_once(tmp_path):
    config = _config(tmp_path, max_wall_s=30.0)
    ticks = []

    def tick():
        ticks.append("begun")
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the user insists: no waiting for the tick's end
        time.sleep(5.0)
        ticks.append("done")

    assert _watch(config, tmp_path, tick) == "interrupted"
    assert ticks == ["begun"]


def test_a_negative_max_train_s_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="run.max_train_s"):
        _config(tmp_path, max_train_s=-1.0)
