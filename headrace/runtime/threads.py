"""The threads launcher: learner, actors and evaluator as threads of one process.

Lifetimes: every worker gets the same stop event; the main thread reports metrics, watches the stop
conditions and joins every worker with a timeout. A worker's exception reaches the main thread and
ends the run with it. Used by tests and single-process runs; the default is the processes launcher.
With `buffer.backend: redis` and no `buffer.url` it starts an embedded Redis in RUN_DIR/redis.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from headrace.config import Config
from headrace.metrics.core import Metrics
from headrace.runtime import build, collector, supervise

log = logging.getLogger(__name__)


class Worker(threading.Thread):
    """A thread whose exception is kept for the launcher instead of vanishing."""

    def __init__(self, name: str, target, stop: threading.Event):
        super().__init__(name=name, daemon=True)
        self._target_fn = target
        self._stop_event = stop
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._target_fn()
        except BaseException as error:  # reported by the launcher
            self.error = error
            log.exception("%s failed", self.name)
            self._stop_event.set()


def train(config: Config, *, live: bool = True, t0: float | None = None) -> dict[str, Any]:
    """Runs a whole training job; returns the summary (also written to RUN_DIR/summary.json).

    `t0` is the unix time the run's wall clock (`run.max_wall_s`, `wall_s`) counts from: by
    default this call's; the command line passes its process's start."""
    t0 = time.time() if t0 is None else t0
    build.check_flow(config)
    run_dir = build.make_run_dir(config)
    server, config = build.start_embedded_redis(config, run_dir)  # password kept in memory
    url = config.buffer.url or (server.url if server else "")
    try:
        return _train(config, run_dir, t0, live,
                      build.make_buffer(config, url=url, run_id=run_dir.name, consumer="learner"))
    finally:
        if server is not None:
            server.stop()


def _train(config: Config, run_dir, t0: float, live: bool, buffer) -> dict[str, Any]:
    task = build.build_task(config)
    build.kept_episodes(config, task)  # a config error now, not in every actor
    graphdef, params = build.init_params(config, task)
    weights = build.make_weights(config, run_dir)
    metrics = Metrics()
    stop = threading.Event()
    admission = build.make_admission(config, buffer)
    pins = build.make_pins(config, run_dir)  # the weights of each evaluation point
    evaluator = supervise.Evaluator(config, task, graphdef, weights, metrics, t0,
                                    lambda: metrics.snapshot().get("actor/episodes", 0), pins)
    learner = build.make_learner(config, task, graphdef, params, buffer, weights, metrics, stop,
                                 admission=admission, run_dir=run_dir, pins=pins)
    learner.publish(wait=True)  # version 0, before any actor starts
    workers = [Worker("learner", learner.run, stop),
               Worker("evaluator", lambda: evaluator.run(stop), stop)]
    for i in range(config.actor.num_actors):
        actor = build.make_actor(config, task, f"actor-{i}",
                                 build.actor_sampler(config, task, graphdef, i, weights), buffer, weights,
                                 metrics, stop, admission=admission)
        workers.append(Worker(f"actor-{i}", actor.run, stop))
    reporter = supervise.Reporter(config, run_dir, live)
    with collector.settled():  # what was built leaves the collector's scans while the run lasts
        for worker in workers:
            worker.start()
        try:
            stopped_by = supervise.watch(
                config, t0, snapshot=lambda: {**metrics.snapshot(), **buffer.stats()},
                reporter=reporter, evaluator=evaluator, failed=stop.is_set,
                finished=learner.done.is_set)
        finally:
            stop.set()
            for worker in workers:
                worker.join(timeout=30)
    errors = [f"{w.name}: {type(w.error).__name__}: {w.error}" for w in workers if w.error]
    if errors:  # a worker's failure, whatever else was seen first
        stopped_by = "error"
    return supervise.finish(run_dir, t0, evaluator, reporter,
                            {**metrics.snapshot(), **buffer.stats()}, stopped_by, errors)
