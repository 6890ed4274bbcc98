"""The benchmarks' steal clock reads the hypervisor's stolen time from /proc/stat."""

import os
import time

import pytest

from headrace import benchlib


@pytest.mark.timeout(30)
def test_steal_clock_reads_the_steal_column_between_two_times(monkeypatch):
    stolen = iter(range(0, 10_000, 50))  # ticks: 50 more at every read
    monkeypatch.setattr(benchlib.StealClock, "_read",
                        lambda self: next(stolen) / os.sysconf("SC_CLK_TCK"))
    with benchlib.StealClock([0], every_s=0.05) as clock:
        start = time.time()
        time.sleep(0.5)
        end = time.time()
    reads = clock.stolen_s(start, end) / (50 / os.sysconf("SC_CLK_TCK"))
    assert reads == pytest.approx(round(reads)) and reads >= 5  # whole samples, twenty a second
    assert clock.stolen_s(end, start) == 0.0


@pytest.mark.timeout(30)
def test_steal_clock_reads_this_machine():
    with benchlib.StealClock([0]) as clock:
        time.sleep(0.1)
    assert clock.stolen_s(0.0, time.time() + 1) >= 0.0
    assert clock._read() >= 0.0
