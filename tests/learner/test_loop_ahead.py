"""The learner builds step k+1's batch while step k trains, gated at the version k+1 trains at."""

from __future__ import annotations

import threading
import time
import types

import pytest

from headrace.buffer.memory import MemoryBuffer
from headrace.config import load
from headrace.learner.loop import Learner
from headrace.metrics.core import Metrics
from headrace.runtime import build
from headrace.types import Entry
from headrace.weights.memory import MemoryWeightStore
from tests.learner.test_checkpointing import actions, make_group, model  # noqa: F401 (fixture)


def make_learner(model, buffer, max_policy_lag: int, max_steps: int):  # noqa: F811
    task, graphdef, params = model
    config = load("examples/guess_number.yaml", [
        "learner.groups_per_batch=2", "learner.minibatches=1", "buffer.max_pending=64",
        f"staleness.max_policy_lag={max_policy_lag}", f"run.max_steps={max_steps}"])
    learner = build.make_learner(config, task, graphdef, params, buffer, MemoryWeightStore(4),
                                 Metrics(), threading.Event())
    learner.publish_start()
    return learner


def run(learner: Learner, stop_when) -> None:
    thread = threading.Thread(target=learner.run, daemon=True)
    thread.start()
    while thread.is_alive() and not stop_when():
        thread.join(0.05)
    learner.stop.set()
    thread.join(60)
    assert not thread.is_alive()


@pytest.mark.timeout(120)
def test_batches_are_built_ahead_and_lag_is_that_of_the_train_version(model):  # noqa: F811
    buffer = MemoryBuffer(capacity=1000, max_pending=64)
    buffer.put([make_group(i, actions(model)) for i in range(12)], timeout_s=1)  # version 0
    learner = make_learner(model, buffer, max_policy_lag=100, max_steps=6)
    lags = []
    record = learner._record_staleness
    learner._record_staleness = lambda entries: (
        lags.append({learner.version - e.group.oldest_version for e in entries}),
        record(entries))
    run(learner, lambda: learner.done.is_set())
    assert learner.step == 6
    assert lags == [{k} for k in range(6)]  # step k+1 trains at version k: lag k
    waits = learner.metrics.distribution("learner/wait_data_s")
    assert waits.quantiles((0.5,))[0] == 0.0  # most batches were ready when their step began
    between = learner.metrics.distribution("learner/between_steps_s")  # the audit's publish_s
    # One per step after the first. Between steps is host bookkeeping only (the next batch's
    # gathering, `host_s`, is left out; the weights are written on the publisher's thread):
    # milliseconds for this model. 1 s was a speed claim a loaded machine can miss; 10 s still
    # catches a step boundary that blocks for seconds (e.g. on a poll or store timeout).
    assert between.count == 5 and 0.0 <= between.max() < 10.0


@pytest.mark.timeout(120)
def test_a_batch_built_ahead_is_gated_at_the_version_it_will_train_at(model):  # noqa: F811
    buffer = MemoryBuffer(capacity=1000, max_pending=64)
    buffer.put([make_group(i, actions(model)) for i in range(20)], timeout_s=1)  # version 0
    learner = make_learner(model, buffer, max_policy_lag=2, max_steps=50)
    metrics = learner.metrics
    run(learner, lambda: metrics.snapshot().get("staleness/dropped_lag", 0)
        + 2 * learner.step >= 20)
    # Versions 0, 1, 2 are within the limit; from version 3 on every group is too old.
    assert learner.step == 3
    assert metrics.snapshot()["staleness/dropped_lag"] == 14
    assert metrics.snapshot()["staleness/lag_max"] == 2


def test_cpu_frac_leaves_out_the_cpu_of_steps_that_compiled(model, monkeypatch):  # noqa: F811
    """`learner/cpu_frac` is the process's CPU over the steady-state window: a step that compiled
    is left out of both, once (the first step usually compiles)."""
    learner = make_learner(model, MemoryBuffer(capacity=10, max_pending=64), 4, 2)
    batch = types.SimpleNamespace(real_tokens=100)
    cpu = iter([12.0, 12.0, 12.3])  # the process's CPU at each read after the two dispatches
    monkeypatch.setattr(time, "process_time", lambda: next(cpu))
    start = time.perf_counter() - 3.0
    learner.clock.record(2.0, start, 10.0, batch.real_tokens, compiled=True)  # 2 s compiling
    learner.clock.record(0.5, start + 2.0, 12.0, batch.real_tokens, compiled=False)
    window = learner.metrics.gauges["learner/steps_per_s"] ** -1  # one steady step
    assert learner.metrics.gauges["learner/cpu_frac"] == pytest.approx(0.3 / window, rel=1e-3)


@pytest.mark.timeout(120)
def test_each_step_gauges_the_mean_reward_of_the_episodes_it_trains(model):  # noqa: F811
    groups = [make_group(i, actions(model)) for i in range(6)]
    for i, group in enumerate(groups):  # a different reward mean per group
        for j, trajectory in enumerate(group.trajectories):
            trajectory.reward = float(i + 3 * j)
    buffer = MemoryBuffer(capacity=1000, max_pending=64)
    buffer.put(groups, timeout_s=1)
    learner = make_learner(model, buffer, max_policy_lag=100, max_steps=3)
    seen = []
    record = learner._record_staleness

    def check(entries):
        record(entries)
        trained = [t.reward for e in entries for t in e.group.trajectories]
        seen.append((sum(trained) / len(trained),
                     learner.metrics.snapshot()["learner/reward_mean"]))

    learner._record_staleness = check
    run(learner, lambda: learner.done.is_set())
    assert len(seen) == 3 and len({want for want, _ in seen}) == 3
    for want, got in seen:
        assert got == pytest.approx(want)


def test_token_lag_counts_each_generated_token_at_the_version_that_made_it(model):  # noqa: F811
    """A group's lag is its oldest token's; where weights were refreshed between turns its later
    tokens are newer, and `staleness/token_lag_mean` is their mean lag."""
    learner = make_learner(model, MemoryBuffer(capacity=10, max_pending=64), max_policy_lag=100,
                           max_steps=1)
    groups = [make_group(i, actions(model)) for i in range(2)]
    for g, made in zip(groups, ([3, 5, 7], [6, 6, 6])):  # generated tokens sit at 1, 3 and 5
        for t in g.trajectories:
            t.policy_version[1::2] = made
    learner.version = 9
    learner._record_staleness([Entry(f"e{i}", g) for i, g in enumerate(groups)])
    snapshot = learner.metrics.snapshot()
    assert snapshot["staleness/lag_mean"] == pytest.approx(((9 - 3) + (9 - 6)) / 2)
    assert snapshot["staleness/token_lag_mean"] == pytest.approx(9 - (3 + 5 + 7 + 6 + 6 + 6) / 6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("processes", [1, 2])
def test_a_feed_blocked_for_its_share_reports_what_it_lacks(model, processes):  # noqa: F811
    """With several learner processes the ready cap counts what every one holds, so a process
    blocked for its share reports what it lacks (`waiting_for`), and 0 once fed; one process
    reports nothing (the cap never refuses what it lacks)."""
    from headrace.learner.book import Book
    from headrace.learner.feed import Feed
    from headrace.learner.gate import StalenessGate
    from headrace.metrics.traces import Tracer

    task = model[0]
    config = load("examples/guess_number.yaml", ["learner.groups_per_batch=4",
                                                 "buffer.max_pending=64"])
    buffer, metrics, stop = MemoryBuffer(capacity=100, max_pending=64), Metrics(), threading.Event()
    reports: list[int] = []
    book = Book(config, buffer, metrics)
    feed = Feed(config, buffer, None, StalenessGate(config.staleness, metrics), book, metrics,
                Tracer(None, MemoryWeightStore(2), metrics), stop, task.dims.vocab_size,
                processes, report=lambda: reports.append(feed.waiting_for))
    need = 4 // processes
    buffer.put([make_group(i, actions(model)) for i in range(need - 1)], timeout_s=1)
    feed.start()
    got: list = []
    thread = threading.Thread(target=lambda: got.append(feed.next(0)), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while feed.waiting_for != (1 if processes > 1 else 0) or not thread.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)  # blocked: still lacking one
        assert thread.is_alive() and not got
        buffer.put([make_group(need, actions(model))], timeout_s=1)
        thread.join(30)
        assert not thread.is_alive() and len(got[0][0]) == need
    finally:
        stop.set()
        feed.close()
    assert reports == ([1, 0] if processes > 1 else []) and feed.waiting_for == 0


@pytest.mark.timeout(60)
def test_a_lone_feed_that_drops_what_it_holds_reports_it_before_it_waits(model):  # noqa: F811
    """Groups dropped (here for lag) count as queued for the learner until admission hears they
    were handled; a lone learner left waiting without saying so waited for ever, the ready cap
    holding back new groups for it (the chaos bench after a resume)."""
    from headrace.learner.book import Book
    from headrace.learner.feed import Feed
    from headrace.learner.gate import StalenessGate
    from headrace.metrics.traces import Tracer

    config = load("examples/guess_number.yaml", ["learner.groups_per_batch=4",
                                                 "buffer.max_pending=64"])
    buffer, metrics, stop = MemoryBuffer(capacity=100, max_pending=64), Metrics(), threading.Event()
    book = Book(config, buffer, metrics)
    reports: list[int] = []
    feed = Feed(config, buffer, None, StalenessGate(config.staleness, metrics), book, metrics,
                Tracer(None, MemoryWeightStore(2), metrics), stop, model[0].dims.vocab_size,
                report=lambda: reports.append(len(book.unacked)))
    buffer.put([make_group(i, actions(model)) for i in range(3)], timeout_s=1)  # version 0
    feed.start()
    thread = threading.Thread(target=lambda: feed.next(10), daemon=True)  # lag 10 > 4: dropped
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not reports:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.01)
        time.sleep(0.2)  # still blocked: no second report for the same drops
        assert thread.is_alive() and reports == [3]
        assert metrics.counters["staleness/dropped_lag"] == 3
    finally:
        stop.set()
        feed.close()
