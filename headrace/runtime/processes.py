"""The processes launcher (the default): a supervisor, one learner process, N actor processes.

The supervisor (the `headrace train` process) starts the embedded `redis-server` when no
`buffer.url` is given (append-only file in RUN_DIR/redis), the directory weight store in
RUN_DIR/weights, then spawns the learner and the actors. Children die with the supervisor, even when
it is SIGKILLed (PR_SET_PDEATHSIG). A crashed actor is restarted with exponential backoff and
counted (`actor/restarts`); after `actor.max_restarts` crashes in a row (a run of HEALTHY_S resets
the count) its error ends the run. A crashed learner ends the run. Either way the summary's
`errors` carries the reason the child left (`worker.record_failure`) and the command exits
non-zero. Ctrl-C, the end of the run or an error: SIGTERM to every child, a grace period, then
SIGKILL; Redis is shut down last.

Crash safety (`headrace.runtime.resume`): a run writes RUN_DIR/run.json (its id) when it starts;
`train(..., resume_dir=RUN_DIR)` continues it: the same run id (so the same Redis keys), Redis
restarted on RUN_DIR/redis from its append-only file, the learner restored from its latest
checkpoint in RUN_DIR/checkpoints, fresh actors, metrics appended to metrics.jsonl.

Greedy evaluation runs on a thread of the supervisor, reading published weights from the store.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import pathlib
import signal
import threading
import time
from typing import Any

import redis

from headrace import placement
from headrace.buffer.base import BufferError
from headrace.buffer.redis_stream import call_with_retry, enable_ledger
from headrace.config import Config, ConfigError
from headrace.metrics.core import Metrics
from headrace.metrics.remote import metrics_key
from headrace.metrics.remote import read as read_metrics
from headrace.model import params as params_lib
from headrace.parallel import multihost
from headrace.runtime import build, resume, supervise, worker

log = logging.getLogger(__name__)

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
# How long a stopping child may take to finish its step (a compile of a new shape included) and
# its final checkpoint before it is killed: a kill is for a hang, and costs the final checkpoint.
# At least this; longer when the learner's steps are (`stop_grace_s`).
GRACE_S = 120.0
HEALTHY_S = 120.0  # an actor that ran this long before crashing starts a fresh restart count
MESH_CHECK_S = 180.0  # the mesh check process: a start, JAX and an accelerator opened (a TPU: ~15 s)


class LaunchError(RuntimeError):
    """The run could not start (a child failed before the run began); the message says why."""


@dataclasses.dataclass
class Child:
    name: str
    target: Any
    args: tuple
    process: multiprocessing.process.BaseProcess | None = None
    restarts: int = 0  # crashes in a row (see HEALTHY_S)
    next_start: float = 0.0
    started_at: float = 0.0


class Supervisor:
    def __init__(self, config: Config, run_dir, url: str, run_id: str, actors: bool = True):
        self.config = config
        self.run_dir = run_dir
        self.url = url
        self.run_id = run_id
        self._context = multiprocessing.get_context("spawn")
        data = build.without_secrets(config).to_dict()  # the password goes by the environment
        run = config.run
        processes = config.parallel.processes
        usable = placement.usable_cpus()
        actor_cpus = placement.actor_cpus(run, usable, processes)  # the learner's left
        coordinator = f"127.0.0.1:{multihost.free_port()}" if processes > 1 else ""
        self.learners = [
            Child("learner" if processes == 1 else f"learner-{i}", worker.learner_main,
                  (data, str(run_dir), url, run_id,
                   placement.learner_cpus(run, i, processes, usable), i, processes, coordinator))
            for i in range(processes)]
        self.learner = self.learners[0]  # process 0: publishes weights, decides when it is done
        count = config.actor.num_actors if actors else 0
        self.actors = [Child(f"actor-{i}", worker.actor_main,
                             (data, str(run_dir), url, run_id, i,
                              placement.actor_share(actor_cpus, i, count)))
                       for i in range(count)]
        self.failure: str | None = None
        self.restarts = 0
        self.stopping = False
        self.grace_s = GRACE_S  # `stop_grace_s` of the run's metrics, kept current by `train`

    def _start(self, child: Child) -> None:
        worker.failure_path(self.run_dir, child.name).unlink(missing_ok=True)  # an older one's
        process = self._context.Process(target=child.target, args=child.args, name=child.name,
                                        daemon=False)
        with build.password_for_children(self.config):
            process.start()
        child.started_at = time.monotonic()
        child.process = process  # only once started: stop() joins what it finds here

    def why(self, child: Child) -> str:
        """How `child` ended: its exit code and the reason it recorded, if any."""
        code = child.process.exitcode
        how = (f"was killed by signal {signal.Signals(-code).name}" if code is not None
               and code < 0 else f"exited with code {code}")
        reason = worker.read_failure(self.run_dir, child.name)
        return f"{child.name} {how}" + (f": {reason}" if reason else "")

    def learner_gone(self) -> str | None:
        """Why learner process 0 is no longer running, or None while it runs."""
        return None if self.learner.process.is_alive() else self.why(self.learner)

    def finished(self) -> bool:
        """Learner process 0 ended by itself (run.max_steps)."""
        return self.learner.process.exitcode == 0

    def start_learner(self) -> None:
        for child in self.learners:
            self._start(child)

    def start_actors(self) -> None:
        for child in self.actors:
            self._start(child)

    def check(self) -> None:
        """Restarts crashed actors (with backoff); records a learner failure."""
        now = time.monotonic()
        if self.stopping:
            return
        for child in self.learners:
            learner = child.process
            if learner is not None and not learner.is_alive() and learner.exitcode != 0 \
                    and self.failure is None:  # exit code 0: it finished (run.max_steps)
                self.failure = self.why(child)
        for child in self.actors:
            process = child.process
            if process is None or process.is_alive():
                if process is None and now >= child.next_start and self.failure is None:
                    self._start(child)
                continue
            why = self.why(child)
            if now - child.started_at >= HEALTHY_S:
                child.restarts = 0  # it ran well for a while: a fresh count
            child.process = None
            if child.restarts >= self.config.actor.max_restarts:
                if self.failure is None:
                    self.failure = (f"{why} (crashed {child.restarts + 1} times in a row; "
                                    f"actor.max_restarts={self.config.actor.max_restarts})")
                continue
            backoff = BACKOFF_S[min(child.restarts, len(BACKOFF_S) - 1)]
            log.warning("%s; restarting in %.0f s", why, backoff)
            child.next_start = now + backoff
            child.restarts += 1
            self.restarts += 1

    def stop(self) -> None:
        self.stopping = True  # exits from here on are ours, not failures
        children = [c.process for c in (*self.actors, *self.learners) if c.process is not None]
        for process in children:
            if process.is_alive():
                process.terminate()  # SIGTERM: the child sets its stop event and finishes
        if self.grace_s > GRACE_S and any(p.is_alive() for p in children):
            log.warning("stopping: waiting up to %.0f s for the learner to finish its step",
                        self.grace_s)
        deadline = time.monotonic() + self.grace_s
        for process in children:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("%s did not stop in %.0f s; killing it", process.name, self.grace_s)
                process.kill()
                process.join(timeout=5)


def stop_grace_s(metrics: dict[str, float]) -> float:
    """The grace a stop gives the children: GRACE_S, or twice the learner's p90 step time when
    that is longer, so a learner in the middle of a long step (a 135M model on a CPU: 40-175 s)
    finishes it, publishes and checkpoints instead of being killed with the step lost."""
    return max(GRACE_S, 2.0 * float(metrics.get("learner/step_s_p90", 0.0)))


def check_mesh_apart(config: Config, timeout_s: float = MESH_CHECK_S) -> None:
    """`check_mesh` (the mesh fits the devices and the model) where the learner process will
    run it: in a process of its own that opens JAX's default backend as the learner does and
    lets it go when it ends. Here JAX stays off the accelerator (`worker.use_cpu_backend`): a
    process that opened a TPU would hold it, one that opened GPUs most of their memory. A check
    process that fails otherwise or gives no answer is logged and skipped (the learner process
    checks the mesh again when it builds its step).

    Raises:
      ConfigError: what `check_mesh` refuses, before anything starts.
    """
    from headrace.learner.sharded_step import checks_mesh_at_start

    if not checks_mesh_at_start(config):  # nothing to check: no process started for it
        return
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=worker.mesh_check_main, name="mesh-check", daemon=True,
                              args=(build.without_secrets(config).to_dict(), send))
    process.start()
    send.close()
    try:
        answer = receive.recv() if receive.poll(timeout_s) else None
    except EOFError:
        answer = None
    finally:
        process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join()
    if answer is None:
        log.warning("the mesh check process gave no answer (exit code %s); the learner process "
                    "checks parallel.mesh when it starts", process.exitcode)
    elif answer:
        raise ConfigError(answer)


def train(config: Config, *, live: bool = True, t0: float | None = None,
          resume_dir: str | pathlib.Path | None = None,
          make_supervisor=Supervisor, start_buffer=build.start_embedded_redis,
          standalone: bool = False) -> dict[str, Any]:
    """Runs a whole training job over processes; returns the summary (also in summary.json).

    Args:
      t0: the unix time the run's wall clock (`run.max_wall_s`, `wall_s`) counts from: by
        default this call's; the command line passes its process's start.
      resume_dir: continue this run folder (with `config` from `resume.load_config`).
      make_supervisor: `(config, run_dir, url, run_id)` -> what starts, watches and stops the
        learner and actors (`Supervisor`'s methods); the Ray launcher passes its own.
      start_buffer: `build.start_embedded_redis`'s signature and result (a server with `url`,
        `dir`, `running`, `start` and `stop`); the Ray launcher's starts it on a node of its
        choosing.
      standalone: the learner side alone (`headrace learner`): no actor processes; the run is
        announced in Redis for `headrace actor` processes started elsewhere
        (`headrace.runtime.standalone`), and marked ended when it stops.

    Raises:
      ConfigError: a fresh run in a folder that holds one, a folder that cannot be resumed, or
        (processes launcher) `run.learner_cpus` or `run.actor_cpus` naming CPUs this machine lacks.
    """
    t0 = time.time() if t0 is None else t0
    build.check_flow(config)
    if config.buffer.backend != "redis" or config.weights.backend not in ("dir", "redis"):
        raise ConfigError(f"run.launcher={config.run.launcher} needs buffer.backend=redis and "
                          f"weights.backend=dir or redis, not {config.buffer.backend} and "
                          f"{config.weights.backend}")  # Config refuses it before this
    if config.actor.platform != "default":  # the evaluator's sampler: the learner's accelerator
        worker.use_cpu_backend()
    task = build.build_task(config)  # refused here, before anything starts (a sandbox missing)
    check_mesh_apart(config)  # in the learner process it would fail alone
    if make_supervisor is Supervisor:  # here, not in a child that fails on them alone
        placement.check(config.run)
    # From here on config.buffer.password is the clients' password, in memory only.
    if resume_dir is None:
        resume.check_new_run_dir(config)
        run_dir = build.make_run_dir(config)
        run_id = resume.start_run(run_dir, config)
        server, config = start_buffer(config, run_dir)
    else:
        run_dir = pathlib.Path(resume_dir).absolute()
        # First: a run whose passwords cannot be found is refused before the resume is recorded.
        as_given = build.without_secrets(config)  # written: not the server's weights.url
        server, config = start_buffer(config, run_dir, resume=True)
        run_id = resume.read_run(run_dir)["run_id"]
    url = config.buffer.shard_url(0, server.url if server is not None else "")
    client = redis.Redis.from_url(url, password=config.buffer.password or None)
    metrics = Metrics()  # the supervisor's own: evaluation and restarts
    revive_lock = threading.Lock()
    supervisor = None  # made once the run's keys are set up

    def revive() -> None:
        """Restarts a crashed embedded Redis (same port, its append-only file reloaded: with
        `buffer.fsync: always` nothing acknowledged to a writer is lost) before the children's
        retries run out. Called every tick, while the learner starts, and by every retry of the
        supervisor's own calls."""
        with revive_lock:
            if server is not None and not server.running and not (
                    supervisor is not None and supervisor.stopping):
                log.warning("the embedded redis-server exited; restarting it from its "
                            "append-only file in %s", server.dir)
                server.start()
                metrics.count("buffer/server_restarts")

    def retried(what: str, fn):
        """`fn()` on the run's Redis, a lost connection retried for 30 s (a busy server can
        stall past redis-py's 5 s socket timeout; a crashed one is restarted)."""
        return call_with_retry(fn, where=url, what=what, retry_s=30.0, error=BufferError,
                               on_retry=revive)

    try:
        if resume_dir is not None:
            # refused before anything is recorded: the folder stays as it was
            retried("the resume check", lambda: resume.check_resumable(run_dir, client, run_id))
            resume.begin_resume(run_dir, as_given)
            build.clear_pins(run_dir)  # evaluation points of steps the crash undid: trained again
            # The crashed run's processes left their last metrics in the server (its learner's
            # step, which the crash may have undone): the resumed run's start afresh, its
            # learner's from its checkpoint, and no view of it shows the undone steps.
            retried("clearing the crashed run's metrics",
                    lambda: client.delete(metrics_key(run_id)))
        if config.run.ledger:  # before any child opens the buffer; on every shard
            for shard in range(config.buffer.shard_count):
                if config.buffer.urls and shard:
                    other = redis.Redis.from_url(config.buffer.urls[shard],
                                                 password=config.buffer.password or None)
                    enable_ledger(other, run_id, shard)
                    other.close()
                else:
                    retried("enabling the ledger",
                            lambda shard=shard: enable_ledger(client, run_id, shard))
        supervisor = (Supervisor(config, run_dir, url, run_id, actors=False) if standalone
                      else make_supervisor(config, run_dir, url, run_id))

        def tick() -> None:
            revive()
            supervisor.check()

        build.kept_episodes(config, task)  # a config error now, not in every actor
        weights = build.make_weights(config, run_dir)
        graphdef = params_lib.graphdef(task.dims)

        def snapshot() -> dict[str, float]:
            merged = retried("reading metrics", lambda: read_metrics(client, run_id))
            merged.update(metrics.snapshot())
            merged["actor/restarts"] = supervisor.restarts
            supervisor.grace_s = stop_grace_s(merged)
            return merged

        evaluator = supervise.Evaluator(config, task, graphdef, weights, metrics, t0,
                                        lambda: snapshot().get("actor/episodes", 0),
                                        build.make_pins(config, run_dir))
        supervisor.start_learner()
        # Beside the learner, not after it: an actor's start (its imports, engine, compiles)
        # overlaps the learner's, and it acts from version 0 once published (`wait_first`).
        supervisor.start_actors()
        while weights.latest_version() < 0 and supervisor.failure is None:
            gone = supervisor.learner_gone()
            if gone is not None:
                raise LaunchError(f"the learner exited before publishing version 0: "
                                  f"{gone}; see the log above")
            # An actor that crashes while it waits is restarted, or after actor.max_restarts
            # ends the run (`watch` sees the failure at once), not only once version 0 is out.
            tick()
            time.sleep(0.1)
        if standalone:
            from headrace.runtime import standalone as standalone_lib

            retried("announcing the run",
                    lambda: standalone_lib.announce(client, run_id, weights, url, config))
        reporter = supervise.Reporter(config, run_dir, live)
        evaluation = supervise.start_thread("evaluator", evaluator.run)
        try:
            stopped_by = supervise.watch(
                config, t0, snapshot=snapshot, reporter=reporter, evaluator=evaluator,
                failed=lambda: supervisor.failure is not None or evaluation.error is not None,
                finished=supervisor.finished,
                tick=tick)
        finally:
            supervisor.stop()
            evaluation.stop()
        errors = [supervisor.failure] if supervisor.failure else []
        if evaluation.error is not None:
            errors.append(f"evaluator: {type(evaluation.error).__name__}: {evaluation.error}")
        if errors:
            stopped_by = "error"
        return supervise.finish(run_dir, t0, evaluator, reporter, snapshot(), stopped_by, errors)
    finally:
        if supervisor is not None:
            supervisor.stop()
        if standalone and supervisor is not None:  # not for a refused resume
            from headrace.runtime import standalone as standalone_lib

            standalone_lib.mark_ended(client, run_id)
            if server is not None:  # actors see the end before the server goes
                time.sleep(standalone_lib.POLL_S * 2)
        client.close()
        if server is not None:
            server.stop()


