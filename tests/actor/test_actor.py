"""The actor survives environment errors and timeouts, counts them, and keeps producing groups."""

import threading
import time

import numpy as np
import pytest

from headrace.buffer.admission import AdmissionLimits, InProcessAdmission
from headrace.buffer.base import BufferError
from headrace.buffer.memory import MemoryBuffer
from headrace.config import ConfigError, load
from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.runtime import build
from headrace.types import STATUS_ERROR, STATUS_OK
from headrace.weights.memory import MemoryWeightStore


@pytest.mark.timeout(120)
def test_errors_and_timeouts_end_episodes_not_the_actor():
    config = load(data={
        "env": {"name": "tests.actor.fakes:FlakyEnv", "step_timeout_s": 0.3},
        "actor": {"envs_per_actor": 8, "group_size": 2, "max_batch": 8},
        "sampling": {"max_new_tokens": 1, "keep_cache": True}, "shapes": {"buckets": [8]},
        "model": {"max_len": 8}})
    task = build.build_task(config)
    graphdef, params = build.init_params(config, task)
    weights = MemoryWeightStore(2)
    weights.publish(params_lib.to_host(params), 0)
    buffer = MemoryBuffer(capacity=1000)
    metrics, stop = Metrics(), threading.Event()
    sampler = build.make_sampler(config, task, graphdef, seed=0, acting=True)
    assert sampler.episodes == 8  # failed episodes must give their kept caches back
    actor = build.make_actor(config, task, "a0", sampler, buffer, weights, metrics, stop)
    thread = threading.Thread(target=actor.run)
    thread.start()
    try:
        deadline = time.monotonic() + 90
        while buffer.depth() < 9 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    entries = buffer.get(100, timeout_s=1)
    assert len(entries) >= 9
    by_seed = {}
    for entry in entries:
        seed = int(entry.group.task_id.split("/")[1])
        by_seed[seed % 3] = [t.status for t in entry.group.trajectories]
        for t in entry.group.trajectories:
            t.validate()
            if t.status == STATUS_ERROR:
                assert ("tool crashed" in t.error) == (seed % 3 == 0)
    assert by_seed[0] == [STATUS_ERROR] * 2
    assert by_seed[1] == [STATUS_ERROR] * 2
    assert by_seed[2] == [STATUS_OK] * 2
    snapshot = metrics.snapshot()
    assert snapshot["env/errors"] >= 2
    assert snapshot["env/timeouts"] >= 2


def test_invalid_action_ends_episode_with_zero_reward():
    from headrace.env.guess_number import GuessNumber

    env = GuessNumber(n=8, max_turns=3)
    env.reset(0)
    obs, reward, terminated, truncated, info = env.step("start")
    assert terminated and reward == 0.0 and info["invalid_action"]
    env.reset(0)
    obs, reward, terminated, truncated, info = env.step("99")
    assert terminated and reward == 0.0 and info["invalid_action"]


class CountingAdmission(InProcessAdmission):
    """Counts its decisions."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.most, self.p90s, self.granted = 0, 0, [], []

    def _decide(self, actor_id, weights_version, p90_episode_s, reserve, count=1):
        self.calls += 1
        self.most = max(self.most, count)
        self.p90s.append(p90_episode_s)
        forecast, leases = super()._decide(actor_id, weights_version, p90_episode_s, reserve,
                                           count)
        self.granted += leases
        return forecast, leases


def admission_setup(envs_per_actor: int, max_policy_lag: int):
    """A small guess_number actor's config, task and model, and a store holding it as version 0."""
    config = load(data={
        "env": {"name": "guess_number", "kwargs": {"n": 8, "max_turns": 2}},
        "actor": {"envs_per_actor": envs_per_actor, "group_size": 2, "max_batch": envs_per_actor},
        "staleness": {"max_policy_lag": max_policy_lag},
        "sampling": {"max_new_tokens": 1}, "shapes": {"buckets": [8]}, "model": {"max_len": 8}})
    task = build.build_task(config)
    graphdef, params = build.init_params(config, task)
    weights = MemoryWeightStore(2)
    weights.publish(params_lib.to_host(params), 0)
    return config, task, graphdef, params, weights


@pytest.mark.timeout(240)
def test_waiting_slots_queue_and_only_the_first_polls_admission():
    """Refused slots wait their turn: the actor's polls are one waiter's, not one per slot."""
    config, task, graphdef, _, weights = admission_setup(64, max_policy_lag=1)
    buffer = MemoryBuffer(capacity=1000)
    admission = CountingAdmission(AdmissionLimits.from_config(config), counts=buffer.counts)
    admission.learner_update(version=10, since_publish=0, handled=0, step_s=0.1)  # v0 too old
    metrics, stop = Metrics(), threading.Event()
    actor = build.make_actor(config, task, "a0", build.make_sampler(config, task, graphdef, seed=0),
                             buffer, weights, metrics, stop, admission=admission)
    thread = threading.Thread(target=actor.run)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while admission.calls == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        first, started = admission.calls, time.monotonic()
        time.sleep(2.0)
        while admission.calls - first < 5 and time.monotonic() < deadline:  # a loaded machine
            time.sleep(0.05)
        polls, elapsed = admission.calls - first, time.monotonic() - started
        assert buffer.depth() == 0  # nothing was admitted
        # The learner catches up: the head slot asks for the queued slots' leases too.
        admission.learner_update(version=0, since_publish=0, handled=0, step_s=0.1)
        while buffer.depth() < 4 and time.monotonic() < deadline + 60:
            time.sleep(0.05)
        # Once 8 episodes are timed the polls carry their p90 (the limit stops admission at 128
        # groups: 2 batches of 64; the head keeps polling).
        while admission.p90s[-1] is None and time.monotonic() < deadline + 120:
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    # One waiter backs off from 5 to 50 ms: about 20 polls a second. 32 slots polling each on
    # their own would make hundreds a second.
    assert 5 <= polls <= 60 * elapsed, (polls, elapsed)
    assert buffer.depth() >= 4 and admission.most == 32  # every slot was queued behind the head
    assert admission.in_flight() == 0  # leases released after their puts, spare ones at the stop
    # Every written group is timed (admitted to written), and no other; the p90 admission was
    # given is that of the episodes timed by then.
    assert metrics.distribution("actor/group_s").count == buffer.depth()
    episode_s = list(metrics.distribution("actor/episode_s")._values)
    given = [p for p in admission.p90s if p is not None]
    assert given, "no p90 reached admission"
    prefixes = [np.quantile(episode_s[:n], 0.9) for n in range(8, len(episode_s) + 1)]
    assert all(min(abs(p - q) for q in prefixes) < 1e-12 for p in given), (given[-1], prefixes[-1])


@pytest.mark.timeout(120)
def test_spare_leases_save_round_trips_and_are_given_back_when_old(monkeypatch):
    """A slot asking for admission takes ADMIT_SPARE more leases (never more than the actor's
    slots); the next slots take those without a call, and leases left unused past SPARE_TTL_S
    are released and counted, so none holds the window open for nothing."""
    import asyncio

    from headrace.actor import actor as actor_module
    from headrace.actor.policy import WeightSync

    config, task, graphdef, params, weights = admission_setup(10, max_policy_lag=100)
    sampler = build.make_sampler(config, task, graphdef, seed=0)
    sampler.set_params(params, 0)
    admission = CountingAdmission(AdmissionLimits.from_config(config),
                                  counts=MemoryBuffer(capacity=100).counts)
    metrics = Metrics()
    actor = build.make_actor(config, task, "a0", sampler, MemoryBuffer(capacity=100), weights,
                             metrics, threading.Event(), admission=admission)
    monkeypatch.setattr(actor_module, "SPARE_TTL_S", 3600.0)  # none ages: only the count matters

    async def main():
        actor._admit_turn, actor._installed = asyncio.Lock(), asyncio.Event()
        actor._sync = WeightSync(weights, sampler, metrics)
        try:
            leases = [await actor._admit() for _ in range(5)]  # 5 slots: one call, 4 spare
            assert admission.calls == 1 and admission.most == 5  # not 1 + 8: 5 slots at most
            leases.append(await actor._admit())  # the spares are used up: a second call
            assert admission.calls == 2 and len(actor._leases) == 4
            monkeypatch.setattr(actor_module, "SPARE_TTL_S", 0.0)  # every spare is old now
            leases.append(await actor._admit())  # the old ones go back, a third call
            assert admission.calls == 3 and len(actor._leases) == 4
            assert metrics.snapshot()["actor/spare_leases_released"] == 4
            assert admission.in_flight(actor.lease_owner) == len(leases) + 4
            actor._release_spare()  # at stop
            assert admission.release_many(leases) == len(leases)
            return len(leases)
        finally:
            actor._sync.close()

    used = asyncio.run(main())
    assert admission.in_flight() == 0
    assert metrics.snapshot()["actor/spare_leases_released"] == 8
    assert len(admission.granted) == used + 8  # every lease granted was used or given back


def test_kept_caches_too_large_for_memory_are_a_config_error():
    config = load(data={
        "env": {"name": "guess_number"}, "model": {"preset": "tiny", "max_len": 4096},
        "actor": {"envs_per_actor": 65536, "group_size": 8, "max_batch": 512},
        "sampling": {"keep_cache": True}, "shapes": {"buckets": [32, 4096]}})
    task = build.build_task(config)
    graphdef, _ = build.init_params(config, task)
    with pytest.raises(ConfigError, match="lower actor.envs_per_actor or shapes.buckets"):
        build.kept_episodes(config, task)
    with pytest.raises(ConfigError, match="lower actor.envs_per_actor or shapes.buckets"):
        build.make_sampler(config, task, graphdef, seed=0, acting=True)
    build.make_sampler(config, task, graphdef, seed=0)  # a sampler that does not act keeps none


class LostBuffer(MemoryBuffer):
    def put(self, groups, timeout_s):
        raise BufferError("redis at 127.0.0.1:1 unreachable for 30 s")


@pytest.mark.timeout(120)
def test_a_store_lost_for_good_fails_the_actor_instead_of_its_slots_quietly():
    config = load(data={
        "env": {"name": "guess_number", "kwargs": {"n": 4, "max_turns": 2}},
        "actor": {"envs_per_actor": 8, "group_size": 2, "max_batch": 8},
        "sampling": {"max_new_tokens": 1}, "shapes": {"buckets": [8]}, "model": {"max_len": 16}})
    task = build.build_task(config)
    graphdef, params = build.init_params(config, task)
    weights = MemoryWeightStore(2)
    weights.publish(params_lib.to_host(params), 0)
    stop = threading.Event()
    sampler = build.make_sampler(config, task, graphdef, seed=0, acting=True)
    actor = build.make_actor(config, task, "a0", sampler, LostBuffer(capacity=100), weights,
                             Metrics(), stop)
    errors = []

    def run():
        try:
            actor.run()
        except BaseException as error:  # what the actor's process would die of
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=90)
    stop.set()  # (only if it hung: then the assertions below fail)
    thread.join(timeout=30)
    assert errors and isinstance(errors[0], BufferError) and "unreachable" in str(errors[0]), errors


@pytest.mark.timeout(120)
def test_a_restarted_actor_does_not_keep_its_predecessors_leases_alive():
    """An actor restarted under the same id (a `--resume`, a supervisor restart) heartbeats its
    own leases only: the killed one's expire. Renewed by the successor (the leases were the id's),
    they stayed in flight for good with nothing coming, and with the ready cap on admission
    refused a learner process waiting for its share (a hang in the crash tests)."""
    import asyncio

    from headrace.actor.policy import WeightSync

    config, task, graphdef, params, weights = admission_setup(4, max_policy_lag=100)
    now = [0.0]
    admission = InProcessAdmission(AdmissionLimits.from_config(config), lease_ttl_s=30.0,
                                   clock=lambda: now[0])

    def incarnation():
        sampler = build.make_sampler(config, task, graphdef, seed=0)
        sampler.set_params(params, 0)
        return build.make_actor(config, task, "a0", sampler, MemoryBuffer(capacity=100), weights,
                                Metrics(), threading.Event(), admission=admission)

    killed = incarnation()

    async def admit_one(actor):
        actor._admit_turn, actor._installed = asyncio.Lock(), asyncio.Event()
        actor._sync = WeightSync(weights, actor.sampler, actor.metrics)
        try:
            return await actor._admit()
        finally:
            actor._sync.close()

    assert asyncio.run(admit_one(killed)) is not None  # its group never reaches the buffer
    assert admission.in_flight() == 2  # the slot's own lease and a spare (2 slots)
    restarted = incarnation()
    assert restarted.lease_owner != killed.lease_owner
    assert restarted.lease_owner.startswith("a0:")
    now[0] = 20.0
    assert admission.heartbeat(restarted.lease_owner) == 0  # not its predecessor's leases
    now[0] = 31.0
    assert admission.in_flight() == 0  # expired, as a crashed actor's leases must
