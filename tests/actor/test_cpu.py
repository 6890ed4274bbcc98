"""The actor's turn-side CPU accounting (the audit's CPU model reads it)."""

import threading
import time

import pytest

from headrace.actor.cpu import TurnCpu


def _burn(seconds: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


@pytest.mark.timeout(30)
def test_turn_cpu_counts_the_loop_thread_and_its_named_threads_only():
    cpu = TurnCpu(prefix="actor-x-io")
    start = cpu.read()
    burnt, done = threading.Barrier(3), threading.Event()

    def worker(seconds):
        _burn(seconds)
        burnt.wait()
        done.wait(10)  # alive when read: a thread's CPU is read while it lives

    threads = [threading.Thread(target=worker, args=(0.3,), name="actor-x-io_0"),
               threading.Thread(target=worker, args=(0.3,), name="sampler_0")]
    for t in threads:
        t.start()
    try:
        _burn(0.2)  # the calling thread: the event loop's place
        burnt.wait(10)
        used = cpu.read() - start
    finally:
        done.set()
        for t in threads:
            t.join(10)
    assert 0.45 <= used <= 0.62  # 0.2 here + 0.3 in the named thread, not the other's 0.3
