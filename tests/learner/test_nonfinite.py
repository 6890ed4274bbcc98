"""A non-finite loss or gradient norm never reaches the weights: the update is skipped in the
jitted step (parameters, optimizer state and update count exactly as they were) and counted, the
same on one device and on a mesh; a run of such steps stops the learner with a clear error."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

from headrace.buffer.memory import MemoryBuffer
from headrace.config import ConfigError, LearnerConfig, load
from headrace.learner.batching import Batch
from headrace.learner.sharded_step import ShardedTrainStep
from headrace.learner.train_step import SKIPPED, NonFiniteSteps, init_state, make_optimizer, make_train_step
from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.parallel.mesh import make_mesh
from headrace.runtime import build
from headrace.weights.memory import MemoryWeightStore
from tests.learner.test_checkpointing import actions, make_group, model  # noqa: F401 (fixture)
from tests.parallel.helpers import DIMS, learner_config, make_batch


@pytest.fixture(scope="module")
def tiny():
    graphdef, params = params_lib.init(DIMS, 0)
    return graphdef, jax.device_get(params)


def _step(kind: str, graphdef, config: LearnerConfig):
    optimizer = make_optimizer(config.optimizer)
    if kind == "single":
        return make_train_step(graphdef, config, 1.0, optimizer)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    return ShardedTrainStep(graphdef, config, 1.0, optimizer, mesh=mesh)


def _poison(batch: Batch, minibatch: int, field: str, value: float) -> Batch:
    """`batch` with `field` set to `value` on every loss token of one minibatch."""
    for mb in batch.microbatches:
        if mb.minibatch == minibatch:
            arrays = dict(mb.arrays)
            arrays[field] = np.where(arrays["weight"] > 0, np.float32(value),
                                     arrays[field]).astype(np.float32)
            mb.arrays = arrays
    return batch


def _only(batch: Batch, minibatch: int) -> Batch:
    mbs = [mb for mb in batch.microbatches if mb.minibatch == minibatch]
    return Batch(mbs, 1, 0, 0, 0, 0)


def _host(state):
    return jax.device_get((state.step, state.params, state.opt_state))


def _assert_same(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["single", "sharded"])
@pytest.mark.parametrize("field,value", [("advantages", np.nan),  # a NaN loss
                                         ("advantages", 3e38)])  # a finite loss, inf gradient
def test_a_non_finite_update_is_skipped_and_the_rest_applied(tiny, kind, field, value):
    graphdef, params = tiny
    config = learner_config("ppo_clip")  # two minibatches: two updates per step
    step = _step(kind, graphdef, config)
    fresh = init_state(params, step.optimizer, 0.0)
    start = _host(fresh)
    state, metrics = step(fresh, _poison(make_batch(), 0, field, value))
    assert float(metrics[SKIPPED]) == 1.0  # the first update, not the second
    assert int(state.step) == 1
    # The clean minibatch's update from the untouched start: bit for bit what it does alone.
    alone, alone_metrics = _step(kind, graphdef, config)(init_state(params, step.optimizer, 0.0),
                                                         _only(make_batch(), 1))
    assert float(alone_metrics[SKIPPED]) == 0.0
    _assert_same(_host(state), _host(alone))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(_host(state)))

    # Every update non-finite: nothing changes at all, and both are counted.
    bad = _poison(_poison(make_batch(), 0, field, value), 1, field, value)
    again, metrics = step(init_state(params, step.optimizer, 0.0), bad)
    assert float(metrics[SKIPPED]) == 2.0
    _assert_same(_host(again), start)


def _learner(model, buffer, limit: int):  # noqa: F811
    task, graphdef, params = model
    config = load("examples/guess_number.yaml", [
        "learner.groups_per_batch=2", "learner.minibatches=1", "buffer.max_pending=64",
        "staleness.max_policy_lag=1000", "run.max_steps=6",
        f"learner.max_nonfinite_steps={limit}"])
    learner = build.make_learner(config, task, graphdef, params, buffer, MemoryWeightStore(4),
                                 Metrics(), threading.Event())
    learner.publish_start()
    return learner


def _huge_rewards(group):
    """Valid values whose advantages (+-3e38) overflow the gradient: the data passes every check,
    the step does not."""
    for t, r in zip(group.trajectories, (3e38, -3e38)):
        t.reward = r
    return group


@pytest.mark.timeout(120)
def test_consecutive_non_finite_steps_stop_the_run_with_the_weights_before_them(model):  # noqa: F811
    buffer = MemoryBuffer(capacity=100, max_pending=64)
    buffer.put([make_group(i, actions(model)) for i in range(2)], timeout_s=1)  # one clean step
    buffer.put([_huge_rewards(make_group(i, actions(model))) for i in range(2, 12)], timeout_s=1)
    learner = _learner(model, buffer, limit=3)
    with pytest.raises(NonFiniteSteps, match=r"3 consecutive learner steps .*"
                                             r"learner.max_nonfinite_steps=3"):
        learner.run()
    assert learner.step == 4  # the clean step, then three skipped ones
    assert learner.metrics.counters[SKIPPED] == 3
    published = learner.weights.load(learner.weights.latest_version())
    assert all(np.isfinite(v).all() for v in jax.tree.leaves(published))
    assert int(learner.state.step) == 1  # one optimizer update: the clean step's


@pytest.mark.timeout(120)
def test_with_the_limit_off_the_run_goes_on_and_counts(model):  # noqa: F811
    buffer = MemoryBuffer(capacity=100, max_pending=64)
    buffer.put([_huge_rewards(make_group(i, actions(model))) for i in range(12)], timeout_s=1)
    learner = _learner(model, buffer, limit=0)
    learner.run()
    assert learner.step == 6 and learner.metrics.counters[SKIPPED] == 6
    assert int(learner.state.step) == 0


def test_the_limit_is_validated():
    with pytest.raises(ConfigError, match="learner.max_nonfinite_steps"):
        LearnerConfig(max_nonfinite_steps=-1)
