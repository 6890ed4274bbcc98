"""`headrace.actor.writer.GroupWriter`: the groups that finish while an actor's writes are in
flight go in one write (one buffer put, one lease release); a write refused at capacity is tried
again with nothing lost or written twice; a stop abandons what is unwritten; a failed write fails
every group in it."""

import asyncio
import threading
import time

import numpy as np
import pytest

from headrace.actor.writer import MAX_WRITES, GroupWriter
from headrace.buffer.admission import AdmissionLimits, InProcessAdmission
from headrace.buffer.base import BufferError
from headrace.buffer.memory import MemoryBuffer
from headrace.metrics.core import Metrics
from headrace.weights.directory import DirWeightStore
from tests.conftest import make_group

VERSION = 3


class RecordingBuffer(MemoryBuffer):
    """A memory buffer whose puts take `delay_s` each (or raise `fail`) and are recorded: the
    group ids of each call, and the most calls in progress at once."""

    def __init__(self, delay_s: float = 0.0, fail: Exception | None = None, **kwargs):
        super().__init__(**kwargs)
        self.delay_s, self.fail = delay_s, fail
        self.calls: list[list[str]] = []
        self.most_at_once, self._at_once, self._count_lock = 0, 0, threading.Lock()

    def put(self, groups, timeout_s):
        with self._count_lock:
            self._at_once += 1
            self.most_at_once = max(self.most_at_once, self._at_once)
        try:
            time.sleep(self.delay_s)
            if self.fail is not None:
                raise self.fail
            ids = super().put(groups, timeout_s)
            self.calls.append([g.group_id for g in groups])
            return ids
        finally:
            with self._count_lock:
                self._at_once -= 1


@pytest.fixture
def weights(tmp_path):
    store = DirWeightStore(tmp_path / "weights", fsync=False)
    store.publish({"w": np.zeros(2, np.float32)}, VERSION)
    return store


def admission_with(leases: int):
    admission = InProcessAdmission(AdmissionLimits(groups_per_batch=64, publish_every=1,
                                                   max_policy_lag=4))
    return admission, admission.try_admit_many("actor0", 0, count=leases)


def put_all(buffer, weights, admission, leases, stop=None, capacity=64, stop_after_s=None):
    """Puts groups 0..len(leases)-1 at once, as that many slots finishing together."""
    metrics, stop = Metrics(), stop or threading.Event()

    async def main():
        writer = GroupWriter(buffer, weights, admission, metrics, stop, capacity=capacity,
                             put_timeout_s=60.0, actor_id="actor0")
        if stop_after_s is not None:
            asyncio.get_running_loop().call_later(stop_after_s, stop.set)
        groups = [make_group(i) for i in range(len(leases))]
        got = await asyncio.gather(*[writer.put(g, lease) for g, lease in zip(groups, leases)],
                                   return_exceptions=True)
        return got, groups, writer

    got, groups, writer = asyncio.run(main())
    return got, groups, writer, metrics


@pytest.mark.timeout(30)
def test_groups_finished_during_writes_go_in_one_write_and_each_is_written_once(weights):
    buffer = RecordingBuffer(delay_s=0.1, capacity=64)
    admission, leases = admission_with(12)
    got, groups, _, metrics = put_all(buffer, weights, admission, leases)
    assert got == [True] * 12
    # The first two groups take the two write slots; the ten that finish meanwhile go together.
    assert sorted(map(len, buffer.calls)) == [1, 1, 10], buffer.calls
    assert buffer.most_at_once == MAX_WRITES == 2
    written = [group_id for call in buffer.calls for group_id in call]
    assert sorted(written) == sorted(f"g{i}" for i in range(12))  # each exactly once
    assert buffer.depth() == 12
    assert admission.in_flight() == 0  # every lease released, after its group was written
    assert all(g.put_version == VERSION and "put" in t.timings
               for g in groups for t in g.trajectories)
    sizes = metrics.distribution("actor/put_groups")
    assert sizes.count == 3 and sizes.mean() == pytest.approx(4.0)
    assert metrics.distribution("actor/put_s").count == 3


@pytest.mark.timeout(30)
def test_writes_refused_at_capacity_are_tried_again_and_never_exceed_it(weights):
    buffer = RecordingBuffer(capacity=4)
    admission, leases = admission_with(10)
    drained: list[str] = []

    def drain():  # a learner that starts late (the writes are refused meanwhile), then keeps up
        time.sleep(0.6)
        while len(drained) < 10:
            entries = buffer.get(2, timeout_s=0.5)
            buffer.ack([e.id for e in entries])
            drained.extend(e.group.group_id for e in entries)

    learner = threading.Thread(target=drain, daemon=True)
    learner.start()
    got, _, _, _ = put_all(buffer, weights, admission, leases, capacity=4)
    learner.join(10)
    assert got == [True] * 10
    assert max(map(len, buffer.calls)) <= 4  # a write carries no more than the capacity
    assert sorted(drained) == sorted(f"g{i}" for i in range(10))  # none lost, none twice
    assert admission.in_flight() == 0


@pytest.mark.timeout(30)
def test_a_stop_abandons_unwritten_groups_and_leaves_their_leases_to_the_slots(weights):
    buffer = RecordingBuffer(capacity=1)
    buffer.put([make_group(99)], timeout_s=1)  # full, and nobody reads
    buffer.calls.clear()
    admission, leases = admission_with(3)
    got, _, writer, _ = put_all(buffer, weights, admission, leases, stop_after_s=0.4)
    assert got == [False] * 3
    assert not writer._unwritten and buffer.depth() == 1 and buffer.calls == []
    assert admission.in_flight() == 3  # not released: the slots release abandoned leases


@pytest.mark.timeout(30)
def test_a_refused_write_shrinks_until_it_fits_the_slots_that_are_free(weights):
    buffer = RecordingBuffer(delay_s=0.2, capacity=8)
    buffer.put([make_group(90 + i) for i in range(5)], timeout_s=1)  # 3 slots free, nobody reads
    buffer.calls.clear()
    admission, leases = admission_with(8)
    got, _, _, _ = put_all(buffer, weights, admission, leases, capacity=8, stop_after_s=3.0)
    # g0 and g1 take the two write slots and fit; g2..g7 (six) wait, are refused, then three,
    # then one fits the last free slot. A write that stayed at six would never have fitted.
    written = sorted(group_id for call in buffer.calls for group_id in call)
    assert written == ["g0", "g1", "g2"] and got == [True] * 3 + [False] * 5, (buffer.calls, got)
    assert admission.in_flight() == 5


@pytest.mark.timeout(30)
def test_a_failed_write_fails_every_group_it_carried(weights):
    buffer = RecordingBuffer(delay_s=0.1, fail=BufferError("connection lost"), capacity=64)
    admission, leases = admission_with(5)
    got, _, _, _ = put_all(buffer, weights, admission, leases)
    assert all(isinstance(g, BufferError) and "connection lost" in str(g) for g in got), got
    assert admission.in_flight() == 5
