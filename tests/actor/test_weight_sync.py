"""WeightSync loads off the caller's thread, one load at a time, and never moves the sampler back
to an older version, whoever calls `refresh` and however slow the store is."""

import asyncio
import threading
import time

import pytest

from headrace.actor.policy import WeightSync
from headrace.config import load
from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.runtime import build
from headrace.weights.memory import MemoryWeightStore


class GatedStore(MemoryWeightStore):
    """A real in-memory store whose loads wait for `gate` and record how many overlap; older
    versions load slower (so an unserialised pair of loads would finish out of order)."""

    def __init__(self, keep: int):
        super().__init__(keep)
        self.gate = threading.Event()
        self.gate.set()
        self.loads: list[int] = []
        self.in_flight = self.most_in_flight = 0
        self._count = threading.Lock()

    def load(self, version):
        with self._count:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.loads.append(version)
        try:
            assert self.gate.wait(60)
            time.sleep(0.002 * max(0, 20 - version))
            return super().load(version)
        finally:
            with self._count:
                self.in_flight -= 1


class RecordingSampler:
    """Stands in for the sampler's weights slot (its set_params / version), recording installs."""

    def __init__(self):
        self.version = -1
        self.installed: list[int] = []

    def set_params(self, params, version):
        self.installed.append(version)
        self.version = version


@pytest.fixture(scope="module")
def host_params():
    config = load(data={"model": {"preset": "tiny", "max_len": 16}, "shapes": {"buckets": [8]},
                        "env": {"name": "guess_number", "kwargs": {"n": 4}}})
    task = build.build_task(config)
    _, params = build.init_params(config, task)
    return params_lib.to_host(params)


@pytest.mark.timeout(60)
def test_a_slow_load_blocks_neither_the_event_loop_nor_refresh(host_params):
    store = GatedStore(keep=4)
    store.publish(host_params, 0)
    sampler, stop = RecordingSampler(), threading.Event()
    sync = WeightSync(store, sampler, Metrics(), poll_s=0.0)
    store.gate.clear()  # every load now waits until the test lets it through
    ticks = 0

    async def main():
        nonlocal ticks
        waiting = asyncio.create_task(sync.wait_first(stop))
        for _ in range(20):  # the loop keeps running while the load is held
            await asyncio.sleep(0.01)
            ticks += 1
        assert not waiting.done() and sampler.version == -1
        assert sync.refresh() is sync.refresh(force=True)  # one check in flight, returned again
        store.gate.set()
        return await asyncio.wait_for(waiting, 30)

    try:
        assert asyncio.run(main()) is True
    finally:
        store.gate.set()
        sync.close()
    assert ticks == 20 and sampler.installed == [0] and store.most_in_flight == 1


@pytest.mark.timeout(60)
def test_concurrent_refreshes_load_one_at_a_time_and_versions_only_increase(host_params):
    store = GatedStore(keep=32)
    sampler, stop = RecordingSampler(), threading.Event()
    metrics, announced = Metrics(), []
    sync = WeightSync(store, sampler, metrics, poll_s=0.0, on_install=announced.append)
    errors: list[BaseException] = []

    def hammer():  # as the event loop and the sampler's thread both do
        try:
            while not stop.is_set():
                sync.refresh()
        except BaseException as error:
            errors.append(error)
            raise

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        for version in range(20):
            store.publish(host_params, version)
            time.sleep(0.003)
        deadline = time.monotonic() + 30
        while sampler.version < 19 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        # The check in flight, or a new one queued behind it on the one weights thread: once it
        # is done, every install has also recorded its pickup (after set_params, on that thread).
        sync.refresh(force=True, raise_error=False).result(30)
        sync.close()
    assert not errors and not any(t.is_alive() for t in threads)
    assert sampler.version == 19
    assert sampler.installed == sorted(set(sampler.installed))  # strictly increasing
    assert store.most_in_flight == 1
    assert metrics.distribution("weights/pickup_s").count == len(sampler.installed)
    assert announced == sampler.installed  # every install announced (the actor's admission wake)


@pytest.mark.timeout(60)
def test_forced_lag_behind_the_installed_version_is_skipped_and_a_failed_load_is_raised(
        host_params):
    store = GatedStore(keep=8)
    for version in range(6):
        store.publish(host_params, version)
    sampler, metrics = RecordingSampler(), Metrics()
    sync = WeightSync(store, sampler, metrics, forced_lag=2, poll_s=0.0)
    try:
        assert sync.refresh(force=True).result(30) is True and sampler.version == 3
        sampler.version = 5  # a newer version is installed (e.g. by a resumed actor)
        assert sync.refresh(force=True).result(30) is False and sampler.installed == [3]
        store.publish(host_params, 8)
        broken = store.load
        store.load = lambda version: (_ for _ in ()).throw(OSError("disk gone"))
        assert sync.refresh(force=True).result(30) is False
        # The admission path leaves the error for the sampler's thread; the check it starts
        # fails too and is waited for, or the forced check below would return it still in flight.
        checking = sync.refresh(raise_error=False)
        assert checking is not None and checking.result(30) is False
        with pytest.raises(OSError, match="disk gone"):
            sync.refresh()
        assert metrics.snapshot()["weights/load_errors"] >= 1
        store.load = broken
        # The target (8 - 2 = 6) was never published: the latest is loaded instead.
        assert sync.refresh(force=True).result(30) is True and sampler.installed == [3, 8]
    finally:
        sync.close()
