"""The collector setting of a run (`headrace.runtime.collector`): what a run sets, that it still
collects cyclic garbage, and that the threads launcher's caller gets its own setting back."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref

import pytest

from headrace.runtime import collector


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.mark.timeout(60)
def test_a_worker_process_settles_for_good():
    code = ("import gc; from headrace.runtime import collector; collector.settle(); "
            "print(gc.get_threshold()[0], gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=50, check=True).stdout.split()
    assert int(out[0]) == collector.YOUNG_THRESHOLD
    assert int(out[1]) > 1000  # the interpreter's and headrace's start-up objects


@pytest.mark.timeout(60)
def test_cyclic_garbage_is_still_collected_inside_a_run():
    with collector.settled():
        dead = weakref.ref(Node())
        assert dead() is not None  # not yet: a cycle waits for a collection
        keep = [[] for _ in range(3 * collector.YOUNG_THRESHOLD)]  # net allocations
        assert dead() is None, "a young collection should have freed the cycle"
        del keep


@pytest.mark.timeout(60)
def test_the_callers_setting_comes_back_when_the_last_of_overlapping_runs_ends():
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with collector.settled():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():
        first_in.wait(10)
        with collector.settled():
            second_in.set()
            first_out.wait(10)
            seen["after the first ended"] = gc.get_threshold()[0]

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen["after the first ended"] == collector.YOUNG_THRESHOLD
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen
