"""Admission control (docs/design.md, "Admission"): the forecast against a step-by-step reference, and
one suite run against both backends (in-process, and Redis via the session's real redis-server)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import threading
import time

import pytest

from headrace.buffer import MemoryBuffer, RedisBuffer
from headrace.buffer.admission import (
    REFUSED_AGE,
    REFUSED_LAG,
    REFUSED_READY,
    AdmissionError,
    AdmissionLimits,
    InProcessAdmission,
    LearnerState,
    decide,
    trained_at_version,
)
from headrace.buffer.admission_redis import RedisAdmission
from headrace.buffer.admission_wait import Heartbeat, admit, wait_admit

BACKENDS = ["memory", "redis"]


def reference_trained_at(version: int, since_publish: int, queued_ahead: int,
                         groups_per_batch: int, publish_every: int) -> int:
    """Plays the learner step by step: each step trains the next `groups_per_batch` groups in
    arrival order at the current version, and every `publish_every`-th step publishes."""
    left, steps = queued_ahead, since_publish
    while True:
        if left <= groups_per_batch:
            return version  # the new group (the last of the queue) is in this step
        left -= groups_per_batch
        steps += 1
        if steps == publish_every:
            version, steps = version + 1, 0


@pytest.mark.parametrize("v, s, q, gpb, pe, expected", [
    (0, 0, 1, 4, 1, 0),     # empty queue: trained at the current version
    (0, 0, 4, 4, 1, 0),     # fills the first batch exactly
    (0, 0, 5, 4, 1, 1),     # spills into the second batch: one publish later
    (0, 0, 9, 4, 1, 2),
    (3, 0, 12, 4, 1, 5),    # three batches, publish every step
    (3, 1, 1, 4, 2, 3),     # s=1 of 2: the next step is still at version 3
    (3, 1, 5, 4, 2, 4),     # the second step comes after a publish
    (3, 1, 13, 4, 2, 5),    # four batches: 3 + floor((1 + 4 - 1) / 2)
    (7, 2, 1, 8, 3, 7),
    (7, 2, 9, 8, 3, 8),     # s=2 of 3: the very next step publishes first
    (7, 0, 17, 8, 3, 7),    # three batches within one publish period
    (7, 0, 25, 8, 3, 8),
])
def test_formula_hand_computed(v, s, q, gpb, pe, expected):
    assert trained_at_version(v, s, q, gpb, pe) == expected
    assert reference_trained_at(v, s, q, gpb, pe) == expected


def test_formula_matches_step_by_step_reference():
    for v, gpb, pe in itertools.product((0, 5), (1, 2, 3, 7), (1, 2, 4)):
        for s in range(pe):
            for q in range(1, 40):
                assert trained_at_version(v, s, q, gpb, pe) == \
                    reference_trained_at(v, s, q, gpb, pe), (v, s, q, gpb, pe)


class Harness:
    """Builds admission and a buffer of one kind; Redis ones share the test's run id."""

    def __init__(self, kind: str, request):
        self.kind, self._request = kind, request
        self._opened: list = []
        self.buffer = None

    def make(self, limits: AdmissionLimits, lease_ttl_s: float = 30.0):
        if self.kind == "memory":
            self.buffer = MemoryBuffer(capacity=64)
            admission = InProcessAdmission(limits, counts=self.buffer.counts,
                                           lease_ttl_s=lease_ttl_s)
            self._shared = admission
        else:
            server = self._request.getfixturevalue("redis_server")
            self._url, self._run_id = server.url, self._request.getfixturevalue("run_id")
            self.buffer = RedisBuffer(self._url, run_id=self._run_id, consumer="learner0")
            self._opened.append(self.buffer)
            admission = RedisAdmission(self._url, limits, run_id=self._run_id,
                                       lease_ttl_s=lease_ttl_s)
        self._limits, self._ttl = limits, lease_ttl_s
        self._opened.append(admission)
        return admission

    def another(self):
        """What a second actor process sees: the same state through its own connection."""
        if self.kind == "memory":
            return self._shared
        admission = RedisAdmission(self._url, self._limits, run_id=self._run_id,
                                   lease_ttl_s=self._ttl)
        self._opened.append(admission)
        return admission

    def close(self):
        for thing in reversed(self._opened):
            if hasattr(thing, "drop"):
                thing.drop()
            thing.close()


@pytest.fixture(params=BACKENDS)
def harness(request):
    h = Harness(request.param, request)
    try:
        yield h
    finally:
        h.close()


def test_forecast_counts_queued_buffered_and_in_flight(harness, group_factory):
    adm = harness.make(AdmissionLimits(groups_per_batch=4, publish_every=2, max_policy_lag=10))
    harness.buffer.put([group_factory(i) for i in range(8)], timeout_s=5)
    # Delivered to the learner: counted as its queue at once, before any report of its own.
    got = harness.buffer.get(6, timeout_s=5)
    assert len(got) == 6 and adm.forecast(3).learner_queued == 6
    adm.learner_update(version=3, since_publish=1, handled=2, step_s=0.5)  # 2 trained, unacked
    assert adm.try_admit("a", 3) is not None and adm.try_admit("a", 3) is not None
    f = adm.forecast(3)
    assert (f.learner_queued, f.depth, f.in_flight, f.queued_ahead, f.batches) == (4, 2, 2, 9, 3)
    assert (f.trained_at, f.lag, f.expected_wait_s, f.admitted) == (4, 1, 1.5, True)
    assert adm.in_flight() == 2 and adm.in_flight("a") == 2 and adm.in_flight("b") == 0
    assert adm.learner_state().queued == 4

    adm.learner_update(version=3, since_publish=1, handled=2, step_s=0.5, host="1")
    f = adm.forecast(3)  # a second learner host handled 2 more of the pending entries
    assert (f.learner_queued, f.queued_ahead, f.batches, f.trained_at) == (2, 7, 2, 4)
    assert f.as_dict()["trained_at"] == 4
    harness.buffer.ack([e.id for e in got[:4]])  # acknowledged after the hosts stopped counting
    adm.learner_update(version=3, since_publish=1, handled=0, step_s=0.5)
    adm.learner_update(version=3, since_publish=1, handled=0, step_s=0.5, host="1")
    assert adm.forecast(3).learner_queued == 2


def test_backend_agrees_with_rule(harness, group_factory):
    rng = random.Random(0)
    reasons = set()
    for limits in (AdmissionLimits(3, 1, 2), AdmissionLimits(5, 3, 1, max_age_s=4.0),
                   AdmissionLimits(2, 1, 6, max_ready_batches=1)):
        adm = harness.make(limits)
        harness.buffer.put([group_factory(i) for i in range(10)], timeout_s=5)
        assert len(harness.buffer.get(10, timeout_s=5)) == 10  # pending: the learner's queue
        for _ in range(100):
            adm.learner_update(rng.randrange(10), rng.randrange(limits.publish_every),
                               rng.randrange(20), rng.choice([0.0, 0.1, 1 / 3, 0.7]),
                               waiting_for=rng.choice([0, 0, 2, 30]))
            weights, p90 = rng.randrange(12), rng.choice([None, 0.5, 1.1, 3.9])
            got = adm.forecast(weights, p90)
            state = adm.learner_state()
            want = decide(state, got.depth, 0, limits, weights, p90)
            assert got == want
            alone = decide(dataclasses.replace(state, waiting_for=0), got.depth, 0, limits,
                           weights, p90)  # what the cap would decide with no learner waiting
            reasons.add((limits.max_ready_batches, got.reason, alone.reason))
    # The cap refused, and admitted what a waiting learner lacked where it alone would refuse.
    assert (1, REFUSED_READY, REFUSED_READY) in reasons and (1, "", REFUSED_READY) in reasons


def test_old_weights_refused_until_newer_version(harness):
    adm = harness.make(AdmissionLimits(groups_per_batch=2, publish_every=1, max_policy_lag=1))
    adm.learner_update(version=5, since_publish=0, handled=0, step_s=0.0)
    assert adm.try_admit("a", 3) is None
    assert adm.forecast(3).reason == REFUSED_LAG and adm.forecast(3).lag == 2
    lease = adm.try_admit("a", 4)
    assert lease is not None and (lease.trained_at, lease.queued_ahead) == (5, 1)
    assert adm.try_admit("a", 4) is not None  # Q=2: still the first batch
    assert adm.try_admit("a", 4) is None  # Q=3 spills into version 6
    assert adm.try_admit("a", 5) is not None  # newer weights may take it
    assert adm.in_flight() == 3


@pytest.mark.timeout(30)
def test_racing_actors_never_exceed_the_limit(harness):
    slots = 5  # lag 0, version 0: admissible while Q <= groups_per_batch
    harness.make(AdmissionLimits(groups_per_batch=slots, publish_every=1, max_policy_lag=0))
    views = [harness.another() for _ in range(8)]
    start = threading.Barrier(len(views), timeout=10)
    lock, holding, seen_max, granted, errors = threading.Lock(), [0], [0], [0], []

    def actor(index: int) -> None:
        try:
            adm, name = views[index], f"actor{index}"
            start.wait()
            first = adm.try_admit(name, 0)  # everyone races for the first round at once
            leases = [first] if first else []
            for _ in range(30):
                lease = leases.pop() if leases else adm.try_admit(name, 0)
                if lease is None:
                    continue
                with lock:
                    granted[0] += 1
                    holding[0] += 1
                    seen_max[0] = max(seen_max[0], holding[0])
                time.sleep(0.001)
                with lock:
                    holding[0] -= 1
                assert adm.release(lease)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=actor, args=(i,)) for i in range(len(views))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(25)
    assert not errors and not any(t.is_alive() for t in threads)
    assert seen_max[0] <= slots and granted[0] >= slots
    assert views[0].in_flight() == 0

    # One round, all at once: exactly `slots` winners.
    got = _all_at_once(views, lambda view, name: view.try_admit(name, 0))
    assert sum(lease is not None for lease in got) == slots and views[0].in_flight() == slots


def _all_at_once(views, call) -> list:
    """`call(view, "actorI")` for every view, each on its own thread, released together by a
    barrier; their results in order (an exception in one is raised here)."""
    barrier, results = threading.Barrier(len(views), timeout=10), [None] * len(views)

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = call(views[index], f"actor{index}")
        except BaseException as error:  # raised by the caller
            results[index] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(views))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


# Lease tests: a TTL that a loaded machine's stalls (seconds) do not outlast by accident, yet short
# enough to wait out. Waits "past the TTL" are TTL + 0.5 s.
LEASE_TTL_S = 3.0


@pytest.mark.timeout(30)
def test_crashed_actor_leases_expire(harness):
    adm = harness.make(AdmissionLimits(2, 1, 0), lease_ttl_s=LEASE_TTL_S)
    crashed = [adm.try_admit("crashed", 0), adm.try_admit("crashed", 0)]
    assert all(crashed) and adm.try_admit("alive", 0) is None
    time.sleep(LEASE_TTL_S + 0.5)  # no heartbeat: the TTL passes
    assert adm.in_flight() == 0 and adm.heartbeat("crashed") == 0
    assert adm.try_admit("alive", 0) is not None
    assert not adm.release(crashed[0])  # expired: releasing it is a no-op


@pytest.mark.timeout(30)
def test_heartbeat_keeps_leases_alive(harness):
    adm = harness.make(AdmissionLimits(2, 1, 0), lease_ttl_s=LEASE_TTL_S)
    assert adm.try_admit("a", 0) and adm.try_admit("a", 0)
    with Heartbeat(harness.another(), "a", every_s=0.2) as beat:
        time.sleep(LEASE_TTL_S + 1.0)  # well past the TTL
        assert adm.in_flight("a") == 2 and adm.try_admit("b", 0) is None
    assert beat.beats >= 5 and beat.failures == 0  # ~20 due in 4 s
    assert adm.heartbeat("a") == 2
    time.sleep(LEASE_TTL_S + 0.5)
    assert adm.in_flight() == 0 and adm.try_admit("b", 0) is not None


def test_many_leases_in_one_call_are_what_one_at_a_time_would_take(harness):
    limits = AdmissionLimits(groups_per_batch=4, publish_every=1, max_policy_lag=1)
    adm = harness.make(limits)
    adm.learner_update(version=2, since_publish=0, handled=0, step_s=0.0)
    assert adm.try_admit("x", 2) is not None  # one in flight before the call
    # Q = 2..8 are trained at versions 2 or 3 (lag <= 1); Q = 9 would be trained at 4.
    leases = adm.try_admit_many("a", 2, count=20)
    assert [(lease.queued_ahead, lease.trained_at) for lease in leases] == [
        (q, 2 if q <= 4 else 3) for q in range(2, 9)]
    assert len({lease.lease_id for lease in leases}) == 7
    assert adm.in_flight("a") == 7 and adm.in_flight() == 8
    assert adm.try_admit_many("a", 2, count=3) == [] and adm.forecast(2).reason == REFUSED_LAG
    assert adm.try_admit_many("a", 3, count=1)[0].queued_ahead == 9  # newer weights: admitted
    assert all(adm.release(lease) for lease in leases) and adm.in_flight("a") == 1
    # Each lease of a call agrees with the rule applied with the ones before it in flight.
    state = adm.learner_state()
    want = [decide(state, 0, 2 + k, limits, 2, None) for k in range(3)]
    got = adm.try_admit_many("b", 2, count=3)
    assert [(g.trained_at, g.queued_ahead) for g in got] == [
        (w.trained_at, w.queued_ahead) for w in want]
    with pytest.raises(ValueError, match="count=0"):
        adm.try_admit_many("a", 2, count=0)


@pytest.mark.timeout(30)
def test_racing_batched_calls_take_exactly_the_admissible_slots(harness):
    slots = 7
    harness.make(AdmissionLimits(groups_per_batch=slots, publish_every=1, max_policy_lag=0))
    views = [harness.another() for _ in range(6)]
    got = _all_at_once(views, lambda view, name: view.try_admit_many(name, 0, count=3))
    taken = [lease for leases in got for lease in leases]
    assert len(taken) == slots == views[0].in_flight()
    assert sorted(lease.queued_ahead for lease in taken) == list(range(1, slots + 1))


def test_release_frees_the_slot(harness):
    adm = harness.make(AdmissionLimits(1, 1, 0))
    lease = adm.try_admit("a", 0)
    assert lease is not None and adm.try_admit("b", 0) is None
    assert adm.release(lease) and not adm.release(lease)
    assert adm.try_admit("b", 0) is not None and adm.in_flight("b") == 1


def test_release_many_frees_live_leases_of_several_actors_in_one_call_each(harness):
    adm = harness.make(AdmissionLimits(groups_per_batch=8, publish_every=1, max_policy_lag=0))
    a, b = adm.try_admit_many("a", 0, count=3), adm.try_admit_many("b", 0, count=2)
    assert adm.release(a[0])
    # a[0] is no longer live: counted out, the other four freed; the slots open again
    assert adm.release_many([a[0], a[1], b[0], a[2], b[1]]) == 4
    assert adm.in_flight() == 0 and adm.release_many([a[1], b[1]]) == 0
    assert adm.release_many([]) == 0
    assert len(adm.try_admit_many("c", 0, count=10)) == 8


def test_max_age_refusal(harness, group_factory):
    adm = harness.make(AdmissionLimits(2, 1, max_policy_lag=100, max_age_s=10.0))
    harness.buffer.put([group_factory(i) for i in range(5)], timeout_s=5)
    assert len(harness.buffer.get(5, timeout_s=5)) == 5  # the learner's queue
    adm.learner_update(version=0, since_publish=0, handled=0, step_s=2.0)  # Q=6: 3 batches, 6 s
    assert adm.forecast(0, p90_episode_s=4.0).expected_wait_s == 6.0
    assert adm.forecast(0, p90_episode_s=4.5).reason == REFUSED_AGE  # 6 + 4.5 > 10
    assert adm.try_admit("a", 0, p90_episode_s=4.0) is not None  # 6 + 4 <= 10
    f = adm.forecast(0, p90_episode_s=3.5)  # Q=7 now: 4 batches, 8 s
    assert (f.expected_wait_s, f.reason) == (8.0, REFUSED_AGE)
    assert adm.try_admit("a", 0, p90_episode_s=3.5) is None
    assert adm.try_admit("a", 0, p90_episode_s=None) is not None  # no estimate yet: no age check
    off = harness.make(AdmissionLimits(2, 1, max_policy_lag=100))
    off.learner_update(version=0, since_publish=0, handled=0, step_s=2.0)
    assert off.try_admit("a", 0, p90_episode_s=1e6) is not None  # max_age_s=0: off


def test_ready_cap_refusal(harness, group_factory):
    # 2 groups a batch, a step of 1 s, a p90 episode of 3 s and a cap of 2 batches: a group is
    # admitted while ceil(Q / 2) * 1 <= 3 + 2, Q <= 10, however loose the lag limit. (The Redis
    # backend checks every decision of its script against the rule, `decide`.)
    adm = harness.make(AdmissionLimits(2, 1, max_policy_lag=100, max_ready_batches=2))
    adm.learner_update(version=0, since_publish=0, handled=0, step_s=1.0)
    harness.buffer.put([group_factory(i) for i in range(3)], timeout_s=5)
    assert len(adm.try_admit_many("a", 0, count=10, p90_episode_s=3.0)) == 7  # Q = 3 + 6 + 1
    f = adm.forecast(0, p90_episode_s=3.0)
    assert (f.queued_ahead, f.batches, f.lag, f.reason) == (11, 6, 5, REFUSED_READY)
    assert adm.forecast(0, p90_episode_s=4.0).admitted  # 6 <= 4 + 2
    assert adm.try_admit("a", 0, p90_episode_s=None) is not None  # no estimate yet: no cap
    got = harness.buffer.get(3, timeout_s=5)  # read by the learner: still ahead until trained
    assert len(got) == 3 and adm.forecast(0, p90_episode_s=3.0).reason == REFUSED_READY
    adm.learner_update(version=1, since_publish=0, handled=3, step_s=1.0)  # Q = 0 + 8 + 1
    assert adm.try_admit("a", 0, p90_episode_s=3.0) is not None
    adm.learner_update(version=1, since_publish=0, handled=3, step_s=0.0)  # no step time: no cap
    assert adm.try_admit("a", 0, p90_episode_s=3.0) is not None
    off = harness.make(AdmissionLimits(2, 1, max_policy_lag=100))
    off.learner_update(version=0, since_publish=0, handled=0, step_s=1.0)
    assert off.try_admit("b", 0, p90_episode_s=0.0) is not None  # max_ready_batches=0: off
    with pytest.raises(ValueError, match="max_ready_batches"):
        AdmissionLimits(2, 1, 1, max_ready_batches=-1)


def test_ready_cap_admits_what_a_waiting_learner_process_lacks(harness, group_factory):
    # Two learner processes, 4 groups a batch (2 each): process 0 has read 7 groups (its queue
    # and its share of the next batch) and waits in a collective; process 1 waits for its 2. A
    # step of 1 s against a p90 episode of 0.5 s and a cap of 1: Q = 7 + 1 is 2 batches, 2 > 1.5,
    # so the cap alone refuses, and nothing would ever come for process 1.
    adm = harness.make(AdmissionLimits(4, 1, max_policy_lag=100, max_ready_batches=1))
    harness.buffer.put([group_factory(i) for i in range(7)], timeout_s=5)
    assert len(harness.buffer.get(7, timeout_s=5)) == 7
    adm.learner_update(version=3, since_publish=0, handled=0, step_s=1.0, host="0")
    adm.learner_update(version=3, since_publish=0, handled=0, step_s=1.0, host="1")
    assert adm.forecast(3, p90_episode_s=0.5).reason == REFUSED_READY
    adm.learner_update(version=3, since_publish=0, handled=0, step_s=1.0, host="1", waiting_for=2)
    assert adm.learner_state().waiting_for == 2
    leases = adm.try_admit_many("a", 3, count=5, p90_episode_s=0.5)
    assert len(leases) == 2  # what it lacks, no more: then in flight covers it
    assert adm.forecast(3, p90_episode_s=0.5).reason == REFUSED_READY
    adm.learner_update(version=3, since_publish=0, handled=0, step_s=1.0, host="0", waiting_for=1)
    assert len(adm.try_admit_many("b", 3, count=5, p90_episode_s=0.5)) == 1  # the hosts' sum
    adm.release_many(leases)  # now in the buffer: coming, so still counted
    harness.buffer.put([group_factory(i) for i in range(7, 9)], timeout_s=5)
    assert adm.try_admit("c", 3, p90_episode_s=0.5) is None
    # The lag limit is not relaxed by a waiting learner: weights 3 versions old, limit 2.
    lag = AdmissionLimits(4, 1, max_policy_lag=2, max_ready_batches=1)
    assert decide(LearnerState(5, 0, 0, 1.0, waiting_for=9), 0, 0, lag, 2, 0.5).reason == REFUSED_LAG
    with pytest.raises(ValueError, match="waiting_for=-1"):
        adm.learner_update(version=3, since_publish=0, handled=0, step_s=1.0, waiting_for=-1)


@pytest.mark.timeout(15)
def test_admit_waits_for_newer_weights_and_measures_it(harness):
    adm = harness.make(AdmissionLimits(1, 1, max_policy_lag=1))
    adm.learner_update(version=5, since_publish=0, handled=0, step_s=0.0)
    weights = [3]
    timer = threading.Timer(0.3, lambda: weights.__setitem__(0, 4))  # the actor picks up v4
    timer.start()
    try:
        got = admit(adm, "a", lambda: weights[0], stop=threading.Event(), poll_s=0.02,
                    max_poll_s=0.05)
    finally:
        timer.cancel()
    assert got.lease is not None and got.lease.weights_version == 4
    assert 0.25 <= got.wait_s < 3 and got.attempts > 1 and got.last.reason == REFUSED_LAG


@pytest.mark.timeout(15)
def test_admit_ends_on_stop_and_timeout(harness):
    adm = harness.make(AdmissionLimits(1, 1, 0))
    assert adm.try_admit("a", 0) is not None
    stop = threading.Event()
    timer = threading.Timer(0.2, stop.set)
    timer.start()
    try:
        got = admit(adm, "b", 0, stop=stop, poll_s=0.05, max_poll_s=5.0)  # a stop wakes it
    finally:
        timer.cancel()
    assert got.lease is None and 0.15 <= got.wait_s < 1.5
    got = admit(adm, "b", 0, stop=threading.Event(), timeout_s=0.2)
    assert got.lease is None and 0.15 <= got.wait_s < 1.5 and got.last.reason == REFUSED_LAG


@pytest.mark.timeout(15)
def test_wait_admit_async_after_release(harness):
    adm = harness.make(AdmissionLimits(1, 1, 0))
    held = adm.try_admit("a", 0)
    timer = threading.Timer(0.2, adm.release, args=(held,))
    timer.start()
    try:
        got = asyncio.run(wait_admit(adm, "b", 0, stop=threading.Event(), poll_s=0.02,
                                     max_poll_s=0.05, timeout_s=5))
    finally:
        timer.cancel()
    assert got.lease is not None and got.lease.actor_id == "b" and got.wait_s >= 0.15


@pytest.mark.timeout(30)
def test_wait_admit_refused_for_lag_waits_for_its_wake_not_the_clock(harness):
    """A lag refusal lifts when the actor's weights move: with a `wake`, the wait sleeps until
    it is set (max_poll_s is only the fallback) and polls no sooner; without the wake a refusal
    would be polled again after 1, 2, 4, ... ms."""
    adm = harness.make(AdmissionLimits(1, 1, 0))
    adm.learner_update(3, 0, 0, 0.1)  # version 3, nothing queued
    weights, asked = [2], []  # one version behind the learner: lag 1 > 0

    def weights_version() -> int:
        asked.append(weights[-1])
        return weights[-1]

    async def main():
        wake = asyncio.Event()
        waiting = asyncio.create_task(wait_admit(
            adm, "b", weights_version, stop=threading.Event(), poll_s=0.001, max_poll_s=60,
            wake=wake))
        while not asked:  # the first attempt was refused
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the clock alone would have polled several times
        weights.append(3)  # new weights installed
        wake.set()
        return await asyncio.wait_for(waiting, 20)

    got = asyncio.run(main())
    assert got.lease is not None and got.lease.weights_version == 3
    assert asked == [2, 3] and got.attempts == 2 and got.last.reason == REFUSED_LAG


def test_bad_input_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="groups_per_batch"):
        AdmissionLimits(0, 1, 1)
    with pytest.raises(ValueError, match="max_policy_lag"):
        AdmissionLimits(1, 1, -1)
    adm = InProcessAdmission(AdmissionLimits(1, 1, 0))
    with pytest.raises(ValueError, match="actor_id"):
        adm.try_admit("a b", 0)
    with pytest.raises(ValueError, match="weights_version"):
        adm.try_admit("a", -1)
    with pytest.raises(ValueError, match="since_publish"):
        adm.learner_update(1, -1, 0, 0.0)
    with pytest.raises(ValueError, match="poll_s"):
        admit(adm, "a", 0, stop=threading.Event(), poll_s=0)
    with pytest.raises(ValueError, match="lease_ttl_s"):
        InProcessAdmission(AdmissionLimits(1, 1, 0), lease_ttl_s=0)
    with pytest.raises(ValueError, match="run_id"):
        RedisAdmission("redis://127.0.0.1:1", AdmissionLimits(1, 1, 0), run_id="a b")


@pytest.mark.timeout(10)
def test_unreachable_redis_raises_admission_error():
    adm = RedisAdmission("redis://127.0.0.1:1", AdmissionLimits(1, 1, 0), run_id="r",
                         retry_s=0.2, socket_timeout_s=0.5)
    try:
        start = time.monotonic()
        with pytest.raises(AdmissionError, match="gave up"):
            adm.try_admit("a", 0)
        assert time.monotonic() - start < 3
    finally:
        adm.close()
