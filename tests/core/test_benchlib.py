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
        time.sleep(1.5)  # ~30 samples due; 5 leave a loaded machine's sampler thread room
        end = time.time()
    reads = clock.stolen_s(start, end) / (50 / os.sysconf("SC_CLK_TCK"))
    assert reads == pytest.approx(round(reads)) and reads >= 5  # whole samples, twenty a second
    assert clock.stolen_s(end, start) == 0.0


@pytest.mark.timeout(30)
def test_steal_clock_reads_this_machine_as_psutil_does():
    """The steal column, per core and in total, agrees with psutil's reading of /proc/stat (an
    independent parser) taken between two of ours: a wrong column or unit would not."""
    import psutil  # installed with orbax-checkpoint, which needs it
    tick = 1 / os.sysconf("SC_CLK_TCK")
    for cpus, reference in (([0], lambda: psutil.cpu_times(percpu=True)[0].steal),
                            ([], lambda: psutil.cpu_times().steal)):
        clock = benchlib.StealClock(cpus)
        before, theirs, after = clock._read(), reference(), clock._read()
        assert before - tick <= theirs <= after + tick, (cpus, before, theirs, after)
    with benchlib.StealClock([0], every_s=0.05) as clock:
        time.sleep(0.3)
    assert len(clock._times) >= 2 and clock._steal == sorted(clock._steal)  # a counter
    assert clock.stolen_s(0.0, time.time() + 1) == clock._steal[-1] - clock._steal[0]
