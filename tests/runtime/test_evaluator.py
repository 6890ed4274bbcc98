"""Periodic evaluation: asked for at eval points, never at or past the last step, and a request
still queued when the run stops is evaluated before the final one."""

import time

import pytest

from headrace.config import load
from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.runtime import build, supervise
from headrace.weights.memory import MemoryWeightStore


@pytest.mark.timeout(120)
def test_queued_request_is_evaluated_at_stop_and_the_last_step_is_left_to_the_final():
    config = load(data={"env": {"name": "guess_number", "kwargs": {"n": 8, "max_turns": 3}},
                        "model": {"preset": "tiny", "max_len": 32},
                        "sampling": {"max_new_tokens": 1, "constrain_to_actions": True},
                        "shapes": {"buckets": [8]},
                        "run": {"eval_every": 4, "max_steps": 12}})
    task = build.build_task(config)
    graphdef, params = build.init_params(config, task)
    weights = MemoryWeightStore(keep=4)
    for version in range(3):
        weights.publish(params_lib.to_host(params), version)
    evaluator = supervise.Evaluator(config, task, graphdef, weights, Metrics(), time.time(),
                                    lambda: 0.0)
    evaluator.maybe_request(3)   # before the first point: nothing
    evaluator.maybe_request(5)   # crossed 4
    evaluator.maybe_request(6)   # no new point
    evaluator.maybe_request(12)  # the last step: left to the final evaluation
    assert evaluator.requests.qsize() == 1
    evaluator.drain(before_step=12)  # the run stopped before the evaluator thread took it
    final = evaluator.evaluate_version(12, weights.latest_version())
    assert [(p["step"], p["version"]) for p in evaluator.curve] == [(5, 2), (12, 2)]
    assert 0.0 <= final["success_rate"] <= 1.0
    evaluator.maybe_request(9)   # crossed 8, but the run has stopped at step 9:
    evaluator.drain(before_step=9)  # a request at the final step is the final evaluation
    assert len(evaluator.curve) == 2
