"""Runs a `headrace` command line the way the quick-bench tests do, so that a timeout explains
itself: a run that hangs and a run that is merely slow read differently in the failure."""

import os
import signal
import subprocess
import sys

import pytest

from headrace.benchmarks.chaos import dump_stacks

STACKS_TAIL = 30_000  # characters of stderr a timeout failure shows (stacks of every process)


def run_headrace(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """`python -m headrace.cli ARGS` in a process group of its own, stdout and stderr captured.

    On timeout every process of the group (the command and the learner and actor processes it
    spawned, which share its stderr) prints its threads' Python stacks (`kill -USR1`,
    `headrace.runtime.worker.stacks_on_signal`), the group is killed and the test fails with the
    end of stderr: what each thread was doing when the time ran out.
    """
    process = subprocess.Popen([sys.executable, "-m", "headrace.cli", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # redis-servers run in sessions of their own: they stop when their run's supervisor dies
        dump_stacks(process.pid)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, stderr = process.communicate(timeout=60)
        pytest.fail(f"`headrace {' '.join(args)}` did not finish in {timeout_s:.0f} s; every "
                    f"process's stacks at the timeout, then stderr's end:\n{stderr[-STACKS_TAIL:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
