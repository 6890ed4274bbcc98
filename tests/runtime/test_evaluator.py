"""Periodic evaluation: the learner pins the weights of each multiple of `run.eval_every`; the
evaluator evaluates exactly those (recorded at their step, whatever came after), never at or past
the last step, and a pin still queued when the run stops is evaluated before the final one."""

import threading
import time

import numpy as np
import pytest

from headrace.buffer.memory import MemoryBuffer
from headrace.config import load
from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.runtime import build, supervise
from headrace.weights.base import VersionGone
from headrace.weights.memory import MemoryWeightStore
from tests.learner.test_checkpointing import actions, make_group, model  # noqa: F401 (fixture)

CONFIG = {"env": {"name": "guess_number", "kwargs": {"n": 8, "max_turns": 3}},
          "model": {"preset": "tiny", "max_len": 32},
          "sampling": {"max_new_tokens": 1, "constrain_to_actions": True},
          "shapes": {"buckets": [8]},
          "run": {"eval_every": 4, "max_steps": 12}}


@pytest.mark.timeout(120)
def test_pins_are_evaluated_at_their_step_and_the_last_step_is_left_to_the_final():
    config = load(data=CONFIG)
    task = build.build_task(config)
    graphdef, params = build.init_params(config, task)
    weights, pins = MemoryWeightStore(keep=4), MemoryWeightStore(keep=4)
    for version in range(3):
        weights.publish(params_lib.to_host(params), version)
    evaluator = supervise.Evaluator(config, task, graphdef, weights, Metrics(), time.time(),
                                    lambda: 0.0, pins)
    evaluator.maybe_request(3)   # nothing pinned yet: nothing
    pins.publish(params_lib.to_host(params), 4)
    evaluator.maybe_request(6)   # the learner is past it: the pin of step 4 all the same
    evaluator.maybe_request(7)   # no new pin
    assert evaluator.requests.qsize() == 1
    pins.publish(params_lib.to_host(params), 8)
    evaluator.maybe_request(12)  # the last step: left to the final evaluation
    assert evaluator.requests.qsize() == 1
    evaluator.drain(before_step=12)  # stopped before the evaluator thread took them: newest
    final = evaluator.evaluate_version(12, weights.latest_version())
    assert [p["step"] for p in evaluator.curve] == [8, 12]
    assert 0.0 <= final["success_rate"] <= 1.0
    pins.publish(params_lib.to_host(params), 9)  # a stop at step 9 with a pin there:
    evaluator.drain(before_step=9)  # a pin at the final step is the final evaluation
    assert len(evaluator.curve) == 2
    pins.publish(params_lib.to_host(params), 10)
    evaluator.drain(before_step=11)
    assert [p["step"] for p in evaluator.curve] == [8, 12, 10]
    pins.publish(params_lib.to_host(params), 11)  # keeps 8..11: the pin of step 4 is gone
    with pytest.raises(VersionGone):
        evaluator.evaluate_pin(4)


def test_pins_already_there_at_start_belong_to_an_earlier_start_of_the_run():
    config = load(data=CONFIG)
    task = build.build_task(config)
    graphdef, params = build.init_params(config, task)
    pins = MemoryWeightStore(keep=4)
    pins.publish(params_lib.to_host(params), 8)
    evaluator = supervise.Evaluator(config, task, graphdef, MemoryWeightStore(2), Metrics(),
                                    time.time(), lambda: 0.0, pins)
    evaluator.maybe_request(5)
    assert evaluator.requests.empty()


@pytest.mark.timeout(120)
def test_the_learner_pins_exactly_the_multiples_with_their_weights(model):  # noqa: F811
    """publish_every 3 does not divide eval_every 4: the pins are still the weights of steps
    4 and 8 (not those of a published version), and step 12 (the last) is not pinned."""
    task, graphdef, params = model
    config = load("examples/guess_number.yaml", [
        "run.launcher=threads", "learner.groups_per_batch=2", "learner.minibatches=1",
        "learner.publish_every=3", "buffer.max_pending=64", "staleness.max_policy_lag=100",
        "run.max_steps=12", "run.eval_every=4"])
    weights, pins = MemoryWeightStore(keep=8), MemoryWeightStore(keep=8)
    buffer = MemoryBuffer(capacity=1000, max_pending=64)
    buffer.put([make_group(i, actions(model)) for i in range(24)], timeout_s=1)
    learner = build.make_learner(config, task, graphdef, params, buffer, weights, Metrics(),
                                 threading.Event(), pins=pins)
    learner.publish_start()
    snapshots = {}
    pin = learner._pin

    def pin_and_remember():  # the weights right after each step, as the learner holds them
        snapshots[learner.step] = params_lib.to_host(learner.state.params)
        pin()

    learner._pin = pin_and_remember
    thread = threading.Thread(target=learner.run, daemon=True)
    thread.start()
    thread.join(90)
    assert not thread.is_alive() and learner.step == 12
    kept = [step for step in range(13) if _has(pins, step)]
    assert kept == [4, 8]
    for step in kept:
        pinned = pins.load(step)
        assert pinned.keys() == snapshots[step].keys()
        for name, value in pinned.items():
            np.testing.assert_array_equal(value, snapshots[step][name])
    # Neither pin is a published version's weights (versions are steps 0, 3, 6, 9, 12).
    for step in kept:
        for version in range(weights.latest_version() + 1):
            if _has(weights, version):
                assert not all(np.array_equal(pins.load(step)[k], weights.load(version)[k])
                               for k in pins.load(step))


def _has(store, version) -> bool:
    try:
        store.load(version)
        return True
    except KeyError:
        return False
