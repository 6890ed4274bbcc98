"""Bounded recompilation: a learner fed 200 distinct trajectory lengths compiles at most one
train-step program per (rows, bucket) shape of its policy; with `learner.precompile` it compiles
every shape before its first step and none in a step; weights committed to the device (as a
checkpoint's come) lower the step once per shape, not twice.

Programs are counted twice: JAX traces (one per new input shape, whether or not the persistent
compilation cache then supplies the executable) and backend compilations (`learner/compiles`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import jax
import numpy as np
import pytest

from headrace.buffer.memory import MemoryBuffer
from headrace.config import load
from headrace.metrics import compiles
from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.model.sampler import SamplerSettings
from headrace.model.transformer import ModelDims
from headrace.runtime.build import Task, make_learner
from headrace.shapes import ShapePolicy
from headrace.types import Group, Trajectory
from headrace.weights.memory import MemoryWeightStore

VOCAB = 16
_traces: collections.Counter[str] = collections.Counter()
_lowerings: collections.Counter[str] = collections.Counter()


def _count_traces(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/jaxpr_trace_duration":
        _traces[str(kwargs.get("fun_name", "?"))] += 1
    elif event == "/jax/core/compile/jaxpr_to_mlir_module_duration":  # cache or not, a program
        _lowerings[str(kwargs.get("fun_name", "?"))] += 1


jax.monitoring.register_event_duration_secs_listener(_count_traces)


def groups_with_lengths(lengths, group_size: int) -> list[Group]:
    rng = np.random.default_rng(0)
    groups = []
    for g, start in enumerate(range(0, len(lengths), group_size)):
        items = []
        for j, n in enumerate(lengths[start:start + group_size]):
            mask = np.arange(n) >= n // 3
            items.append(Trajectory(
                f"g{g}.{j}", f"g{g}", f"t{g}", "e", "a",
                rng.integers(0, VOCAB, n).astype(np.int32), mask,
                np.where(mask, -2.7, 0).astype(np.float32), np.where(mask, 0, -1).astype(np.int32),
                [], float(rng.normal()), timings={"started": 0.0}))
        groups.append(Group(f"g{g}", f"t{g}", items, put_version=0))
    return groups


def make_config(steps: int, **learner):
    return load(data={
        "run": {"max_steps": steps},
        "model": {"preset": "custom", "d_model": 16, "n_layers": 1, "n_heads": 2,
                  "n_kv_heads": 1, "d_ff": 32, "max_len": 256},
        "learner": {"groups_per_batch": 5, "minibatches": 1, "token_budget": 512} | learner,
        "shapes": {"buckets": [64, 128, 256]},
        "buffer": {"capacity": 64},
        "staleness": {"max_policy_lag": 1000}})


def make_test_learner(config, lengths, metrics: Metrics, stop: threading.Event,
                      committed: bool = False):
    dims = ModelDims.from_config(config.model, VOCAB)
    graphdef, params = params_lib.init(dims, 0)
    if committed:  # as a checkpoint's weights come: on the device, committed
        params = jax.device_put(params, jax.devices()[0])
    buffer = MemoryBuffer(capacity=64)
    buffer.put(groups_with_lengths(lengths, group_size=4), timeout_s=5)
    task = Task(None, None, dims, SamplerSettings())  # no environment; any token
    return make_learner(config, task, graphdef, params, buffer, MemoryWeightStore(keep=4),
                        metrics, stop)


def run_learner(learner, stop: threading.Event, steps: int) -> None:
    learner.publish_start()
    thread = threading.Thread(target=learner.run, name="test-learner", daemon=True)
    thread.start()
    try:
        thread.join(timeout=150)
        assert not thread.is_alive(), "the learner did not finish its steps"
    finally:
        stop.set()
        thread.join(timeout=10)
    assert learner.step == steps


def train_step_traces() -> int:
    return sum(n for f, n in _traces.items() if "train_step" in f)


@pytest.mark.timeout(180)
def test_learner_compiles_at_most_one_program_per_shape():
    lengths = list(np.random.default_rng(1).permutation(np.arange(2, 202)))  # 200 distinct
    steps = 10
    config = make_config(steps)
    policy = ShapePolicy.from_config(config.shapes, config.learner)
    assert len(policy.shapes()) == 3
    metrics, stop = Metrics(), threading.Event()
    learner = make_test_learner(config, lengths, metrics, stop)
    seen_shapes = set()
    build = learner.batcher.build

    def recording_build(groups):
        batch = build(groups)
        seen_shapes.update(batch.shapes)
        return batch

    learner.batcher.build = recording_build
    traces_before = train_step_traces()
    compiles_before = compiles.compiles("train_step")
    run_learner(learner, stop, steps)
    traces = train_step_traces() - traces_before
    compiled = compiles.compiles("train_step") - compiles_before
    assert seen_shapes <= set(policy.shapes())
    assert 1 <= traces == len(seen_shapes) <= len(policy.shapes())
    assert compiled <= len(policy.shapes())
    assert metrics.gauges["learner/compiles"] >= compiled
    assert metrics.gauges["batch/packing_efficiency"] > 0.5
    assert "batch/truncated" not in metrics.counters


@pytest.mark.timeout(180)
def test_precompile_compiles_every_shape_before_the_first_step_and_none_after():
    # Lengths up to 100: the 256 bucket and some tail shapes never come, yet all are compiled.
    lengths = list(np.random.default_rng(2).permutation(np.arange(2, 102)))
    steps = 4
    config = make_config(steps, precompile=True)
    config = dataclasses.replace(config, shapes=dataclasses.replace(config.shapes, tail_splits=1))
    policy = ShapePolicy.from_config(config.shapes, config.learner)
    assert len(policy.shapes()) == 6
    metrics, stop = Metrics(), threading.Event()
    learner = make_test_learner(config, lengths, metrics, stop)
    seen_shapes, at_first_step = set(), []
    build, step = learner.batcher.build, learner.clock.step

    def recording_build(groups):
        batch = build(groups)
        seen_shapes.update(batch.shapes)
        return batch

    def first_step_traces(*args, **kwargs):
        if not at_first_step:
            at_first_step.append(train_step_traces())
        return step(*args, **kwargs)

    learner.batcher.build, learner.clock.step = recording_build, first_step_traces
    traces_before = train_step_traces()
    run_learner(learner, stop, steps)
    assert len(seen_shapes) < len(policy.shapes())  # compiled ahead: more than the data used
    assert at_first_step[0] - traces_before == len(policy.shapes())  # every one, before a step
    assert train_step_traces() == at_first_step[0]  # no step traced (or compiled) a program
    assert metrics.gauges["learner/precompile_s"] > 0
    assert metrics.gauges["learner/compile_s"] == 0  # no step counted as a compiling one


@pytest.mark.timeout(180)
def test_a_checkpoints_committed_weights_lower_the_step_once_per_shape():
    # One shape (every trajectory 50 tokens: the 64 bucket), three microbatches a step. Weights
    # committed to the device and fresh uncommitted scalars: the step's first microbatch used
    # to lower (and compile) a program of its own, the second another for the committed state
    # the first returned (a real checkpoint's second compile: 50 s for SmolLM2-135M on CPU).
    steps = 3
    config = make_config(steps)
    metrics, stop = Metrics(), threading.Event()
    learner = make_test_learner(config, [50] * 80, metrics, stop, committed=True)
    before = sum(n for f, n in _lowerings.items() if "train_step" in f)
    run_learner(learner, stop, steps)
    assert sum(n for f, n in _lowerings.items() if "train_step" in f) - before == 1
