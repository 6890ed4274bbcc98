"""The processes launcher (the default): a supervisor, one learner process, N actor processes.

The supervisor (the `headrace train` process) starts the embedded `redis-server` when no
`buffer.url` is given (append-only file in RUN_DIR/redis), the directory weight store in
RUN_DIR/weights, then spawns the learner and the actors. Children die with the supervisor, even when
it is SIGKILLed (PR_SET_PDEATHSIG). A crashed actor is restarted with exponential backoff and
counted (`actor/restarts`); a crashed learner ends the run. Ctrl-C, the end of the run or an error:
SIGTERM to every child, a grace period, then SIGKILL; Redis is shut down last.

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
import time
from typing import Any

import redis

from headrace import config as config_lib
from headrace.buffer.base import BufferError
from headrace.buffer.redis_stream import call_with_retry, enable_ledger
from headrace.buffer.server import RedisServer
from headrace.config import Config
from headrace.metrics.core import Metrics
from headrace.metrics.remote import read as read_metrics
from headrace.model import params as params_lib
from headrace.parallel import multihost
from headrace.runtime import build, resume, supervise, worker

log = logging.getLogger(__name__)

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
GRACE_S = 20.0


@dataclasses.dataclass
class Child:
    name: str
    target: Any
    args: tuple
    process: multiprocessing.process.BaseProcess | None = None
    restarts: int = 0
    next_start: float = 0.0


class Supervisor:
    def __init__(self, config: Config, run_dir, url: str, run_id: str):
        self.config = config
        self.run_dir = run_dir
        self.url = url
        self.run_id = run_id
        self._context = multiprocessing.get_context("spawn")
        data = config.to_dict()
        placement = config.run
        processes = config.parallel.processes
        coordinator = f"127.0.0.1:{multihost.free_port()}" if processes > 1 else ""
        self.learners = [
            Child("learner" if processes == 1 else f"learner-{i}", worker.learner_main,
                  (data, str(run_dir), url, run_id, tuple(placement.learner_cpus), i, processes,
                   coordinator))
            for i in range(processes)]
        self.learner = self.learners[0]  # process 0: publishes weights, decides when it is done
        self.actors = [Child(f"actor-{i}", worker.actor_main,
                             (data, str(run_dir), url, run_id, i, tuple(placement.actor_cpus)))
                       for i in range(config.actor.num_actors)]
        self.failure: str | None = None
        self.restarts = 0

    def _start(self, child: Child) -> None:
        process = self._context.Process(target=child.target, args=child.args, name=child.name,
                                        daemon=False)
        process.start()
        child.process = process  # only once started: stop() joins what it finds here

    def start_learner(self) -> None:
        for child in self.learners:
            self._start(child)

    def start_actors(self) -> None:
        for child in self.actors:
            self._start(child)

    def check(self) -> None:
        """Restarts crashed actors (with backoff); records a learner failure."""
        now = time.monotonic()
        for child in self.learners:
            learner = child.process
            if learner is not None and not learner.is_alive() and learner.exitcode != 0 \
                    and self.failure is None:  # exit code 0: it finished (run.max_steps)
                self.failure = f"{child.name} exited with code {learner.exitcode}"
        for child in self.actors:
            process = child.process
            if process is None or process.is_alive():
                if process is None and now >= child.next_start:
                    self._start(child)
                continue
            log.warning("%s exited with code %s; restarting in %.0f s", child.name,
                        process.exitcode, BACKOFF_S[min(child.restarts, len(BACKOFF_S) - 1)])
            child.next_start = now + BACKOFF_S[min(child.restarts, len(BACKOFF_S) - 1)]
            child.restarts += 1
            self.restarts += 1
            child.process = None

    def stop(self) -> None:
        children = [c.process for c in (*self.actors, *self.learners) if c.process is not None]
        for process in children:
            if process.is_alive():
                process.terminate()  # SIGTERM: the child sets its stop event and finishes
        deadline = time.monotonic() + GRACE_S
        for process in children:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("%s did not stop in %.0f s; killing it", process.name, GRACE_S)
                process.kill()
                process.join(timeout=5)


def train(config: Config, *, live: bool = True, t0: float | None = None,
          resume_dir: str | pathlib.Path | None = None) -> dict[str, Any]:
    """Runs a whole training job over processes; returns the summary (also in summary.json).

    Args:
      resume_dir: continue this run folder (with `config` from `resume.load_config`).

    Raises:
      ConfigError: a fresh run in a folder that holds one, or a folder that cannot be resumed.
    """
    t0 = build.process_start_time() if t0 is None else t0
    build.check_flow(config)
    if config.buffer.backend != "redis" or config.weights.backend != "dir":
        config = config_lib.replace(config, buffer={"backend": "redis"},
                                    weights={"backend": "dir"})
    from headrace.parallel.step import check_mesh

    check_mesh(config, build.build_task(config).dims)  # in the learner process it would fail alone
    if resume_dir is None:
        resume.check_new_run_dir(config)
        run_dir = build.make_run_dir(config)
        run_id = resume.start_run(run_dir, config)
    else:
        run_dir = pathlib.Path(resume_dir).absolute()
        run_id = resume.begin_resume(run_dir, config)
    server = None
    if not config.buffer.url:
        server = RedisServer.from_config(config.buffer, run_dir / "redis").start()
    url = config.buffer.url or server.url
    client = redis.Redis.from_url(url, password=config.buffer.password or None)
    if config.run.ledger:
        enable_ledger(client, run_id)  # before any child opens the buffer
    supervisor = Supervisor(config, run_dir, url, run_id)
    metrics = Metrics()  # the supervisor's own: evaluation and restarts
    try:
        task = build.build_task(config)
        build.kept_episodes(config, task)  # a config error now, not in every actor
        weights = build.make_weights(config, run_dir)
        graphdef = params_lib.graphdef(task.dims)

        def snapshot() -> dict[str, float]:
            # A busy server can stall past redis-py's 5 s socket timeout: retried, not fatal.
            merged = call_with_retry(lambda: read_metrics(client, run_id), where=url,
                                     what="reading metrics", retry_s=30.0,
                                     error=BufferError)
            merged.update(metrics.snapshot())
            merged["actor/restarts"] = supervisor.restarts
            return merged

        evaluator = supervise.Evaluator(config, task, graphdef, weights, metrics, t0,
                                        lambda: snapshot().get("actor/episodes", 0))
        supervisor.start_learner()
        while weights.latest_version() < 0:  # actors start from a published version 0
            if not supervisor.learner.process.is_alive():
                raise RuntimeError("the learner exited before publishing version 0 "
                                   f"(code {supervisor.learner.process.exitcode}); see its log")
            time.sleep(0.1)
        supervisor.start_actors()
        reporter = supervise.Reporter(config, run_dir, live)
        evaluation = supervise.start_thread("evaluator", evaluator.run)
        try:
            stopped_by = supervise.watch(
                config, t0, snapshot=snapshot, reporter=reporter, evaluator=evaluator,
                failed=lambda: supervisor.failure is not None,
                finished=lambda: supervisor.learner.process.exitcode == 0,
                tick=supervisor.check)
        finally:
            supervisor.stop()
            evaluation.stop()
        errors = [supervisor.failure] if supervisor.failure and stopped_by == "error" else []
        return supervise.finish(run_dir, t0, evaluator, reporter, snapshot(), stopped_by, errors)
    finally:
        supervisor.stop()
        client.close()
        if server is not None:
            server.stop()


