"""The metrics publisher: a Redis error is retried, any other failure stops the process's work and
is raised by `stop()` (a dead publisher is an error of the run, never a silent loss of metrics)."""

from __future__ import annotations

import threading

import pytest

from headrace.metrics.core import Metrics
from headrace.metrics.remote import Publisher, PublisherError, read
from tests.conftest import make_group


@pytest.mark.timeout(30)
def test_a_failed_publisher_stops_the_process_and_is_raised(redis_server, run_id):
    client = redis_server.client()
    stop = threading.Event()
    calls = []

    def extra():
        calls.append(1)
        if len(calls) >= 2:
            raise ValueError("a broken stats function")
        return {"buffer/depth": 1.0}

    metrics = Metrics()
    metrics.count("learner/steps")
    publisher = Publisher(client, run_id, "learner", metrics, period_s=0.05, extra=extra,
                          on_failure=stop.set).start()
    assert stop.wait(10), "the failure never reached the process's stop event"
    assert read(client, run_id)["buffer/depth"] == 1.0  # the first period was published
    with pytest.raises(PublisherError, match="broken stats function"):
        publisher.stop()


@pytest.mark.timeout(30)
def test_a_healthy_publisher_publishes_on_stop(redis_server, run_id):
    client = redis_server.client()
    metrics = Metrics()
    publisher = Publisher(client, run_id, "actor-0", metrics, period_s=10.0).start()
    metrics.count("actor/episodes", 3)
    publisher.stop()
    assert read(client, run_id)["actor/episodes"] == 3


def test_merge_reduces_as_each_metric_declares():
    """Counters add up; a distribution's tail series and a declared maximum take the worst
    component's; everything else is averaged; no reduction is read off a metric's name."""
    from headrace.metrics.core import MAX, declare
    from headrace.metrics.remote import merge

    declare("test/worst", MAX)
    a, b = Metrics(), Metrics()
    for m, lag, worst, n in ((a, 1.0, 3.0, 2), (b, 3.0, 5.0, 5)):
        m.count("test/episodes", n)
        m.gauge("test/lag", lag)
        m.gauge("test/worst", worst)
        m.gauge("test/looks_max", worst)  # named like a maximum, declared as nothing: a mean
        m.observe_many("test/put_s", [lag] * 10)
    merged = merge({"a": a.export(), "b": b.export()})
    assert merged["test/episodes"] == 7
    assert merged["test/lag"] == 2.0 and merged["test/looks_max"] == 4.0
    assert merged["test/worst"] == 5.0
    assert merged["test/put_s_p99"] == 3.0 and merged["test/put_s_p90"] == 3.0
    assert merged["test/put_s_p50"] == 2.0 and merged["test/put_s_mean"] == 2.0


@pytest.mark.timeout(60)
def test_buffer_stats_from_each_process_add_up_where_they_are_the_clients(redis_server, run_id):
    """Each process publishes its buffer client's `stats`: the server's counts (the same in
    every process) merge to themselves, what a client measured of its own calls (the learner's
    consumption, an actor's blocked puts) adds up instead of being diluted by the other
    processes."""
    from headrace.buffer.memory import MemoryBuffer

    learner, actor = MemoryBuffer(capacity=8), MemoryBuffer(capacity=8)
    learner.put([make_group(0)], timeout_s=1.0)
    assert len(learner.get(1, timeout_s=1.0)) == 1  # the learner's client consumed one
    client = redis_server.client()
    published = {}
    for name, buffer in (("learner", learner), ("actor-0", actor)):
        # the server's depth (the same Redis for both) and a blocked time of each client's
        stats = published[name] = buffer.stats() | {"buffer/depth": 3.0,
                                                     "buffer/put_blocked_s": 0.5}
        Publisher(client, run_id, name, Metrics(), period_s=10.0,
                  extra=lambda stats=stats: stats).start().stop()
    merged = read(client, run_id)
    consumed = published["learner"]["buffer/consume_per_s"]
    assert consumed > 0 and published["actor-0"]["buffer/consume_per_s"] == 0
    assert merged["buffer/consume_per_s"] == consumed
    assert merged["buffer/put_blocked_s"] == 1.0
    assert merged["buffer/depth"] == 3.0



@pytest.mark.timeout(30)
def test_export_is_consistent_while_counters_are_made():
    """A counter made by another thread while the publisher exports is in that export or the
    next, never a KeyError: export read the registry twice, and a counter first counted between
    the two reads killed the publisher, and with it a learner (a group's first drop for lag)."""
    import sys
    import time

    metrics = Metrics()
    for i in range(50):
        metrics.observe(f"series/{i}", 1.0)
    stop, errors = threading.Event(), []

    def make() -> None:
        i = 0
        while not stop.is_set():
            metrics.count(f"counter/{i}")
            i += 1

    def export() -> None:
        try:
            while not stop.is_set():
                data = metrics.export()
                assert set(data["counters"]).isdisjoint(data["values"])
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: the old code failed within 0.5 s
    threads = [threading.Thread(target=make, daemon=True),
               threading.Thread(target=export, daemon=True)]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not errors:
            time.sleep(0.01)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        sys.setswitchinterval(interval)
    assert not errors, errors[0]
    final = metrics.export()["counters"]
    assert len(final) == len(metrics.counters) > 0
