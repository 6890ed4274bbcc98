"""The learner's gates drop whole groups over the lag or age limit, or (when asked) with rewards
that teach nothing, and count each drop."""

import dataclasses
import threading
import time

import numpy as np
import pytest

from headrace.config import StalenessConfig, load
from headrace.learner.advantages import group_advantages, uniform
from headrace.learner.gate import (
    DROP_AGE,
    DROP_COUNTERS,
    DROP_LAG,
    DROP_UNIFORM,
    StalenessGate,
    UniformDrops,
)
from headrace.metrics.core import Metrics
from headrace.types import Group, Trajectory
from tests.learner.test_checkpointing import actions, make_group, model  # noqa: F401 (fixture)


def group(versions, started):
    trajectories = []
    for i, v in enumerate(versions):
        trajectories.append(Trajectory(
            trajectory_id=f"t{i}", group_id="g", task_id="task", env="e", actor_id="a",
            tokens=np.array([1, 5, 6], np.int32), loss_mask=np.array([False, True, True]),
            behaviour_logprobs=np.zeros(3, np.float32),
            policy_version=np.array([-1, v, v + 1], np.int32), turns=[], reward=0.0,
            timings={"started": started}))
    return Group("g", "task", trajectories)


def test_lag_is_measured_from_the_oldest_token_against_the_train_version():
    metrics = Metrics()
    gate = StalenessGate(StalenessConfig(max_policy_lag=2), metrics)
    now = time.time()
    assert gate.check(group([5, 7], now), train_version=7, now=now) is None  # lag 2
    assert gate.check(group([4, 7], now), train_version=7, now=now) == DROP_LAG  # lag 3
    assert metrics.snapshot()["staleness/dropped_lag"] == 1


def test_age_limit():
    metrics = Metrics()
    gate = StalenessGate(StalenessConfig(max_policy_lag=10, max_age_s=5.0), metrics)
    now = time.time()
    assert gate.check(group([1], now - 4.0), 1, now) is None
    assert gate.check(group([1], now - 6.0), 1, now) == DROP_AGE
    snapshot = metrics.snapshot()
    assert snapshot["staleness/dropped_age"] == 1
    assert "staleness/dropped_lag" not in snapshot


def with_rewards(base: Group, rewards, statuses=None) -> Group:
    statuses = statuses or ["ok"] * len(rewards)
    return dataclasses.replace(base, trajectories=[
        dataclasses.replace(t, reward=r, status=s)
        for t, r, s in zip(base.trajectories, rewards, statuses, strict=True)])


def test_a_group_is_uniform_when_its_valid_members_rewards_are_equal():
    assert uniform([-0.05] * 8, [True] * 8)
    assert uniform([1.0, 1.0 + 1e-8], [True, True])  # float32 cannot tell them apart
    assert uniform([1e6, 1e6 + 0.5], [True, True])  # nor these: relative resolution
    assert not uniform([0.0, 1e-4], [True, True])
    assert not uniform([1e6, 1e6 + 2.0], [True, True])
    assert uniform([0.0, 1.0, 0.0], [True, False, True])  # an errored member is no baseline
    assert uniform([1.0, 0.0], [True, False])  # one valid member: no baseline at all
    # where `uniform` says so, every advantage is 0 (std normalisation included)
    for rewards in ([0.3] * 4, [0.0, 1e-9, 0.0, 0.0]):
        for kind in ("grpo", "rloo"):
            adv = group_advantages(np.array(rewards), np.ones(4, bool), kind)
            np.testing.assert_allclose(adv, 0.0, atol=1e-8)


def test_uniform_groups_are_dropped_up_to_the_steps_limit():
    metrics = Metrics()
    drops = UniformDrops(limit=2, metrics=metrics)
    base = group([0, 0, 0], time.time())
    assert drops.group(with_rewards(base, [0.0, 1.0, 0.0])) is None
    assert drops.group(with_rewards(base, [-0.05] * 3)) == DROP_UNIFORM
    assert drops.group(with_rewards(base, [1.0, 0.0, 1.0], ["ok", "error", "ok"])) == DROP_UNIFORM
    assert drops.group(with_rewards(base, [0.5] * 3)) is None  # past the limit: trained
    drops.next_step()
    assert drops.group(with_rewards(base, [0.5] * 3)) == DROP_UNIFORM  # a new step's limit
    assert metrics.counters[DROP_COUNTERS[DROP_UNIFORM]] == 3
    assert metrics.counters["learner/uniform_kept"] == 1
    config = load("examples/guess_number.yaml", ["learner.drop_uniform_groups=true",
                                                 "learner.uniform_drop_limit=0.3"])
    assert UniformDrops.from_config(config.learner, need=32).limit == 10  # ceil(9.6)
    off = load("examples/guess_number.yaml", ["learner.drop_uniform_groups=false"])
    assert UniformDrops.from_config(off.learner, 32) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("drop", "limit"), [(True, 1.0), (True, 0.5), (False, 1.0)])
def test_the_feed_fills_batches_with_informative_groups(model, drop, limit):  # noqa: F811
    """With `learner.drop_uniform_groups` a batch takes groups whose rewards differ and drops
    the others (counted, recorded as handled, so admission hears of them), up to its limit; past
    it a batch takes what comes; the next batch has a limit of its own."""
    from headrace.buffer.memory import MemoryBuffer
    from headrace.learner.book import Book
    from headrace.learner.feed import Feed
    from headrace.metrics.traces import Tracer
    from headrace.weights.memory import MemoryWeightStore

    config = load("examples/guess_number.yaml", [
        "learner.groups_per_batch=4", "buffer.max_pending=64",
        f"learner.drop_uniform_groups={str(drop).lower()}", f"learner.uniform_drop_limit={limit}"])
    buffer, metrics, stop = MemoryBuffer(capacity=100, max_pending=64), Metrics(), threading.Event()
    book = Book(config, buffer, metrics)
    feed = Feed(config, buffer, None, StalenessGate(config.staleness, metrics), book, metrics,
                Tracer(None, MemoryWeightStore(2), metrics), stop, model[0].dims.vocab_size)
    groups = [make_group(i, actions(model)) for i in range(16)]  # odd ones: equal rewards
    groups = [with_rewards(g, [0.0, 0.0]) if i % 2 else g for i, g in enumerate(groups)]
    buffer.put(groups, timeout_s=1)
    feed.start()
    try:
        batches = [[e.group.group_id for e in feed.next(0)[0]] for _ in range(2)]
    finally:
        stop.set()
        feed.close()
    ids = [g.group_id for g in groups]
    counters = metrics.counters
    if not drop:
        assert batches == [ids[:4], ids[4:8]]
        assert DROP_COUNTERS[DROP_UNIFORM] not in counters and "learner/uniform_kept" not in counters
    elif limit == 1.0:  # 4 a batch: never reached here
        assert batches == [ids[0:8:2], ids[8:16:2]]
        assert counters[DROP_COUNTERS[DROP_UNIFORM]] == 7  # the last one still queued
        assert len(book.unacked) == 7  # handled: acknowledged with the next checkpoint
    else:  # 2 a batch: the third group with equal rewards is trained
        assert batches == [[ids[0], ids[2], ids[4], ids[5]], [ids[6], ids[8], ids[10], ids[11]]]
        assert counters[DROP_COUNTERS[DROP_UNIFORM]] == 4 and counters["learner/uniform_kept"] == 2


@pytest.mark.timeout(60)
def test_a_carried_group_is_not_judged_twice(model):  # noqa: F811
    """A batch gathered ahead that came up short carries what passed; used later, those groups
    are gated again for lag but keep the decision their rewards got (kept once, counted once)."""
    from headrace.buffer.memory import MemoryBuffer
    from headrace.learner.book import Book
    from headrace.learner.feed import Feed
    from headrace.metrics.traces import Tracer
    from headrace.weights.memory import MemoryWeightStore

    config = load("examples/guess_number.yaml", [
        "learner.groups_per_batch=4", "buffer.max_pending=64",
        "learner.drop_uniform_groups=true", "learner.uniform_drop_limit=0.25"])  # 1 a batch
    buffer, metrics, stop = MemoryBuffer(capacity=100, max_pending=64), Metrics(), threading.Event()
    feed = Feed(config, buffer, None, StalenessGate(config.staleness, metrics),
                Book(config, buffer, metrics), metrics, Tracer(None, MemoryWeightStore(2), metrics),
                stop, model[0].dims.vocab_size)
    groups = [make_group(i, actions(model)) for i in range(5)]
    groups[:2] = [with_rewards(g, [0.0, 0.0]) for g in groups[:2]]  # the first two alike
    buffer.put(groups[:2], timeout_s=1)
    feed.start()
    try:
        deadline = time.monotonic() + 30
        while feed._queue.qsize() < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        feed.look_ahead(0)  # 1 dropped, 1 kept past the limit and carried: too few for a batch
        counts = dict(metrics.counters)
        buffer.put(groups[2:], timeout_s=1)
        entries, _ = feed.next(0)
    finally:
        stop.set()
        feed.close()
    assert [e.group.group_id for e in entries] == [g.group_id for g in groups[1:]]
    assert counts[DROP_COUNTERS[DROP_UNIFORM]] == 1 and counts["learner/uniform_kept"] == 1
    assert metrics.counters[DROP_COUNTERS[DROP_UNIFORM]] == 1
    assert metrics.counters["learner/uniform_kept"] == 1
