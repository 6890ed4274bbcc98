"""What lets a run share a machine's accelerator out: only the learner process opens it. The
supervisor and the actors keep JAX on the CPU, and the supervisor checks `parallel.mesh` in a
process of its own. (On this CPU-only machine the checks are that this process's JAX is pinned to
the CPU, or not started at all, and that nothing leaks into the environment the learner
inherits; the run on a TPU is in docs/runtime.md, "A learner on an accelerator".)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from headrace.runtime import worker

pytestmark = pytest.mark.timeout(300)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True,
                          text=True, timeout=240)


def test_a_process_that_is_not_the_learner_takes_the_cpu_in_itself_only():
    """`use_cpu_backend` (the supervisor, `actor.platform: cpu` actors) pins JAX's platform in
    the process, not in the environment the learner processes it starts inherit; called again
    once the backend runs (on the CPU), it does nothing."""
    out = _python("import os, jax\nfrom headrace.runtime import worker\nworker.use_cpu_backend()\n"
                  "assert jax.config.jax_platforms == 'cpu' and 'JAX_PLATFORMS' not in os.environ\n"
                  "assert jax.default_backend() == 'cpu'\nworker.use_cpu_backend()\nprint('ok')")
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-2000:]


def test_the_supervisor_checks_the_mesh_without_opening_a_backend_itself():
    """`check_mesh_apart` answers as `check_mesh` would (a mesh the 8 devices take; one they do
    not), while the calling process never starts JAX's backend."""
    code = """
from jax._src import xla_bridge
from headrace import benchlib
from headrace.config import ConfigError, load
from headrace.runtime import processes

example = str(benchlib.EXAMPLES / "guess_number.yaml")
fits = load(example, overrides=["parallel.mesh={data: 2, fsdp: 2, tensor: 2}",
                                "model.vocab_size=40"])
processes.check_mesh_apart(fits)
try:
    processes.check_mesh_apart(load(example, overrides=["parallel.mesh={data: 3, fsdp: 1}"]))
except ConfigError as error:
    print("refused:", error)
assert not xla_bridge.backends_are_initialized()
print("ok")
"""
    out = _python(code, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == "ok" and "multiply to 3 but there are 8 devices" in lines[0], out.stdout


@pytest.mark.parametrize("platform, beside_learner, cpu", [
    ("auto", True, True),  # the processes launcher's actors: the learner's machine
    ("auto", False, False),  # Ray's bundles, `headrace actor`: hosts of their own
    ("cpu", False, True),
    ("default", True, False),
])
def test_where_an_actor_keeps_jax(platform, beside_learner, cpu):
    assert worker.actor_on_cpu(platform, beside_learner) == cpu


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable CPUs")
def test_auto_gives_a_learner_on_an_accelerator_its_cpus_back():
    """`run.learner_cpus: auto` pins the learner process before JAX starts; once its backend
    shows an accelerator (here JAX's answer is replaced: this machine has none), every thread of
    the process, those started while it was pinned too, gets the CPUs back. A learner on the
    CPU, or one pinned by the user's list, stays pinned."""
    code = """
import os, threading, jax
from headrace import benchlib
from headrace.config import load
from headrace.runtime import worker

example = str(benchlib.EXAMPLES / "guess_number.yaml")
everywhere = frozenset(os.sched_getaffinity(0))
os.sched_setaffinity(0, {min(everywhere)})
done = threading.Event()
thread = threading.Thread(target=done.wait, daemon=True)  # a failed assert exits at once
thread.start()
pinned = lambda: {os.sched_getaffinity(t) == {min(everywhere)} for t in (0, thread.native_id)}
assert not worker.release_cpus(load(example), everywhere) and pinned() == {True}  # on the CPU
jax.default_backend = lambda: "tpu"
listed = load(example, overrides=[f"run.learner_cpus=[{min(everywhere)}]"])
assert not worker.release_cpus(listed, everywhere) and pinned() == {True}  # the user's list
assert worker.release_cpus(load(example), everywhere) and pinned() == {False}
assert os.sched_getaffinity(thread.native_id) == everywhere
done.set()
print("ok")
"""
    out = _python(code)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-3000:]
