"""Entry points of the learner and actor processes (spawned by the processes launcher).

Each child ties its life to the supervisor (SIGKILL when the parent dies, Linux PR_SET_PDEATHSIG),
turns SIGTERM/SIGINT into its stop event, pins itself to its CPUs and limits XLA's threads before
JAX is imported, then builds its component from the config, tunes Python's cyclic collector for a
long run (`collector.settle`) and runs it. Metrics go to Redis
(`headrace.metrics.remote`). A child that fails logs the error and exits non-zero; the supervisor
restarts actors with backoff and ends the run when the learner fails. The reason travels in a
file, RUN_DIR/failures/NAME.json (`record_failure`; written even when Redis is what failed), which
the supervisor reads into the summary's `errors`.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import pathlib
import signal
import sys
import threading
from typing import Any

from headrace.rundir import RunDir
from headrace.runtime import collector

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
log = logging.getLogger(__name__)


def failure_path(run_dir: str | os.PathLike, name: str) -> pathlib.Path:
    return pathlib.Path(run_dir) / RunDir.FAILURES / f"{name}.json"


def record_failure(run_dir: str | os.PathLike, name: str, error: BaseException) -> None:
    """Leaves `error` for the supervisor (atomically: a half-written reason is never read)."""
    import json
    import time

    path = failure_path(run_dir, name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"name": name, "time": time.time(),
                                   "error": f"{type(error).__name__}: {error}"}))
        tmp.replace(path)
    except OSError:  # the exit code still says it failed; the log has the traceback
        logging.getLogger(__name__).exception("%s: its failure could not be recorded", name)


def read_failure(run_dir: str | os.PathLike, name: str) -> str | None:
    """The reason `record_failure` left for `name`, or None."""
    import json

    try:
        return json.loads(failure_path(run_dir, name).read_text())["error"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _recording(run_dir: str, name: str):
    """A context manager: an exception leaving it is recorded for the supervisor, then raised."""
    import contextlib

    @contextlib.contextmanager
    def guard():
        try:
            yield
        except BaseException as error:
            if not isinstance(error, SystemExit) or error.code not in (0, None):
                record_failure(run_dir, name, error)
            raise

    return guard()


STACKS_SIGNAL = signal.SIGUSR1


def stacks_on_signal() -> None:
    """`kill -USR1 PID` prints every thread's Python stack on the process's stderr (the run's
    log) and the process goes on: how a stop that hangs is diagnosed. The supervisor and every
    child register it. Not where stderr has no file descriptor (`main` called inside a program
    that captures it, as pytest does)."""
    try:
        faulthandler.register(STACKS_SIGNAL, all_threads=True)
    except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is an OSError
        pass


def _setup(name: str, cpus: tuple[int, ...], supervised: bool = True) -> threading.Event:
    """`supervised`: a child of the supervisor (it dies with it, Ctrl-C is the supervisor's);
    else a process on its own (`headrace actor`): SIGINT stops it like SIGTERM."""
    # stdout belongs to the supervisor (`--json` prints one object there): a child's output, even
    # from C++ libraries (Gloo's connection messages), goes to stderr.
    sys.stdout.flush()
    os.dup2(2, 1)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if supervised:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # The process's name in `ps -o comm`, top and /proc/PID/comm: "learner", "actor-0", ...
    libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    if supervised and os.getppid() == 1:  # the supervisor died before we got here
        sys.exit(1)
    if cpus:  # XLA:CPU sizes its thread pool by these (one CPU: one XLA thread)
        os.sched_setaffinity(0, cpus)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s")
    stacks_on_signal()
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    # Ctrl-C is the supervisor's to handle; a process on its own stops on it
    signal.signal(signal.SIGINT, signal.SIG_IGN if supervised else on_signal)
    return stop


def use_cpu_backend() -> None:
    """This process's JAX computes on the CPU whatever accelerator the machine has, which it
    leaves to the learner process: only one process at a time may open a TPU, and a process that
    opens a GPU reserves most of its memory. For the processes launcher's supervisor (its greedy
    evaluation) and actors (`actor.platform`). In this process only (not through the
    environment: the learner processes it starts must see the accelerator). Warns when JAX has
    already opened another backend here, which then holds the accelerator."""
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        if jax.default_backend() != "cpu":
            log.warning("JAX already runs on %s in this process, so it holds the accelerator "
                        "the learner needs: start the run from a process that has not used JAX",
                        jax.default_backend())
        return
    jax.config.update("jax_platforms", "cpu")


def actor_on_cpu(platform: str, beside_learner: bool) -> bool:
    """Whether an actor process keeps JAX on the CPU: `actor.platform` cpu, or auto where it
    shares the learner's machine (the processes launcher's actors)."""
    return platform == "cpu" or (platform == "auto" and beside_learner)


def mesh_check_main(config_data: dict[str, Any], send) -> None:
    """The mesh check process (`processes.check_mesh_apart`): sends "" when `parallel.mesh` fits
    this machine's devices (JAX's default backend, as the learner process opens it) and the
    model, else the ConfigError's message."""
    from headrace.config import ConfigError, load
    from headrace.learner.sharded_step import check_mesh
    from headrace.runtime import build

    config = load(data=config_data)
    try:
        check_mesh(config, build.build_task(config).dims)
    except ConfigError as error:
        send.send(str(error))
    else:
        send.send("")
    send.close()


def _common(config_data: dict[str, Any], run_dir: str, actor: bool = False,
            beside_learner: bool = False):
    from headrace.config import load
    from headrace.runtime import build

    config = load(data=config_data)
    if actor and actor_on_cpu(config.actor.platform, beside_learner):
        use_cpu_backend()  # before anything starts JAX's backend
    task = build.build_task(config)
    weights = build.make_weights(config, run_dir)
    return config, task, weights


def learner_main(config_data: dict[str, Any], run_dir: str, url: str, run_id: str,
                 cpus: tuple[int, ...], process_id: int = 0, processes: int = 1,
                 coordinator: str = "") -> None:
    """One learner process; with `processes` > 1, process `process_id` of a jax.distributed job
    whose coordinator listens on `coordinator` (host:port)."""
    name = "learner" if processes == 1 else f"learner-{process_id}"
    everywhere = frozenset(os.sched_getaffinity(0))  # before pinning: see `release_cpus`
    stop = _setup(name, cpus)
    with _recording(run_dir, name):
        _learner(config_data, run_dir, url, run_id, process_id, processes, coordinator, stop,
                 name, everywhere=everywhere if cpus else None)


def release_cpus(config, everywhere: frozenset[int]) -> bool:
    """`run.learner_cpus: auto` pins a learner process before JAX starts (XLA:CPU sizes its pool
    by the CPUs it may use then). One whose backend turns out to be an accelerator gets back the
    CPUs it had before, on every thread: its step does not run on the CPU, and its host work
    (reading, decoding and batching groups, publishing, the accelerator runtime's threads) would
    share one core. Returns whether it did."""
    import jax

    if config.run.learner_cpus != "auto" or jax.default_backend() == "cpu":
        return False
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), everywhere)
        except OSError:
            pass  # a thread that has just ended
    return True


def _learner(config_data, run_dir, url, run_id, process_id, processes, coordinator, stop,
             name, everywhere: frozenset[int] | None = None) -> None:
    """`everywhere`: the CPUs of the process before it was pinned (`release_cpus`)."""
    if processes > 1:
        from headrace.parallel import multihost

        multihost.initialize(coordinator, processes, process_id)  # before any computation
    from headrace.learner.checkpoint import Checkpointer
    from headrace.metrics.core import Metrics
    from headrace.metrics.remote import Publisher
    from headrace.runtime import build, resume

    config, task, weights = _common(config_data, run_dir)
    buffer = build.make_buffer(config, url=url, run_id=run_id, consumer=f"learner-{process_id}",
                               host=process_id, hosts=processes)
    graphdef, params = build.init_params(config, task)  # JAX's backend runs from here on
    if everywhere is not None:
        release_cpus(config, everywhere)
    metrics = Metrics()
    publisher = Publisher(buffer.client, run_id, name, metrics, extra=buffer.stats,
                          on_failure=stop.set).start()
    admission = build.make_admission(config, buffer, url=url, run_id=run_id)
    # Crash safety: restore the latest checkpoint of the run folder, if any (a resumed run).
    # Every learner process opens it: each saves and restores its own shards.
    checkpointer = Checkpointer(pathlib.Path(run_dir) / RunDir.CHECKPOINTS,
                                keep=resume.CHECKPOINTS_KEPT)
    ledger = resume.Ledger(pathlib.Path(run_dir) / RunDir.LEDGER,
                           process_id if processes > 1 else None) if config.run.ledger else None
    try:
        primary = process_id == 0  # traces and pins: process 0's
        learner = build.make_learner(
            config, task, graphdef, params, buffer, weights, metrics, stop, admission=admission,
            checkpointer=checkpointer, ledger=ledger, run_dir=run_dir if primary else None,
            pins=build.make_pins(config, run_dir) if primary else None)
        learner.publish_start()  # version 0, or the restored weights after a resume
        collector.settle()
        learner.run()
    finally:
        publisher.stop()
        buffer.close()
        checkpointer.close()
        if ledger is not None:
            ledger.close()


def actor_main(config_data: dict[str, Any], run_dir: str, url: str, run_id: str, index: int,
               cpus: tuple[int, ...], name: str = "") -> None:
    """One actor process. `name` (default `actor-INDEX`) set: a standalone actor
    (`headrace.runtime.standalone`), on its own, without a run folder, that stops when the run
    is marked ended."""
    standalone = bool(name)
    name = name or f"actor-{index}"
    stop = _setup(name, cpus, supervised=not standalone)
    if standalone:
        _actor(config_data, run_dir, url, run_id, index, stop, name, standalone)
        return
    with _recording(run_dir, name):
        _actor(config_data, run_dir, url, run_id, index, stop, name, standalone,
               beside_learner=True)


def _actor(config_data, run_dir, url, run_id, index, stop, name, standalone,
           beside_learner: bool = False) -> None:
    """`beside_learner`: a processes launcher's actor, on the learner's machine (`actor.platform:
    auto` keeps its JAX on the CPU); else on a host of its own (Ray's, `headrace actor`)."""
    from headrace.metrics.core import Metrics
    from headrace.metrics.remote import Publisher
    from headrace.model import params as params_lib
    from headrace.runtime import build

    config, task, weights = _common(config_data, run_dir, actor=True,
                                    beside_learner=beside_learner)
    buffer = build.make_buffer(config, url=url, run_id=run_id, consumer=name)
    metrics = Metrics()
    publisher = Publisher(buffer.client, run_id, name, metrics, extra=buffer.stats,
                          on_failure=stop.set).start()
    if standalone:
        from headrace.runtime import standalone as standalone_lib

        standalone_lib.watch_end(buffer.client, run_id, stop)
    graphdef = params_lib.graphdef(task.dims)
    sampler = build.actor_sampler(config, task, graphdef, index, weights)
    actor = None
    try:
        admission = build.make_admission(config, buffer, url=url, run_id=run_id)
        actor = build.make_actor(config, task, name, sampler, buffer, weights, metrics, stop,
                                 admission=admission)
        collector.settle()
        actor.run()
    finally:
        publisher.stop()
        buffer.close()
    if actor is not None and actor.discarded:
        # An environment call that timed out may still hold a thread that never returns, and
        # the interpreter would wait for it at exit: leave now, everything is written.
        logging.shutdown()
        sys.stderr.flush()
        os._exit(0)
