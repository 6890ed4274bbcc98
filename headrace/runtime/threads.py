"""The threads launcher: learner, actors and evaluator as threads of one process.

Lifetimes: every worker gets the same stop event; the main thread reports metrics, watches the stop
conditions (max steps, max wall time, target reached, Ctrl-C, a worker's error) and joins every
worker with a timeout. A worker's exception reaches the main thread and ends the run with it.
"""

from __future__ import annotations

import logging
import pathlib
import queue
import threading
import time
from typing import Any

from headrace.actor.actor import Actor
from headrace.actor.evaluate import eval_seeds, evaluate
from headrace.config import Config
from headrace.learner.loop import Learner
from headrace.metrics.core import Metrics
from headrace.metrics.sinks import JsonlSink, LiveView, TensorBoardSink
from headrace.model import params as params_lib
from headrace.runtime import build

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


class Evaluator:
    """Greedy evaluation of published versions, off the learner's thread."""

    def __init__(self, config: Config, task: build.Task, graphdef, weights, metrics: Metrics,
                 t0: float):
        self.config = config
        self.task = task
        self.weights = weights
        self.metrics = metrics
        self.t0 = t0
        self.sampler = build.make_sampler(config, task, graphdef, seed=config.run.seed + 7)
        probe = task.make_env()
        self.seeds = eval_seeds(probe, 64)
        probe.close()
        self.requests: queue.Queue[tuple[int, int] | None] = queue.Queue()
        self.curve: list[dict[str, float]] = []
        self.time_to_target_s: float | None = None
        self.reached = threading.Event()

    def evaluate_version(self, step: int, version: int) -> dict[str, float]:
        flat = self.weights.load(version)
        self.sampler.set_params(params_lib.from_host(flat), version)
        result = evaluate(self.task.make_env, self.task.tokenizer, self.sampler, self.seeds,
                          self.config.env.step_timeout_s, self.config.actor.max_batch)
        wall = time.time() - self.t0
        point = {"wall_s": round(wall, 2), "step": step, "version": version,
                 "episodes": self.metrics.snapshot().get("actor/episodes", 0),
                 "success_rate": result["success_rate"]}
        self.curve.append(point)
        self.metrics.gauge("eval/success_rate", result["success_rate"])
        if result["success_rate"] >= self.config.run.eval_target and self.time_to_target_s is None:
            self.time_to_target_s = wall
            self.reached.set()
        log.info("eval step %d: success %.3f at %.1f s", step, result["success_rate"], wall)
        return result

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                request = self.requests.get(timeout=0.1)
            except queue.Empty:
                continue
            while not self.requests.empty():  # fall behind gracefully: evaluate the newest
                request = self.requests.get_nowait()
            step, version = request
            try:
                self.evaluate_version(step, version)
            except KeyError:  # pruned meanwhile (VersionGone): the next request will do
                continue


def train(config: Config, *, live: bool = True, t0: float | None = None) -> dict[str, Any]:
    """Runs a whole training job; returns the summary (also written to RUN_DIR/summary.json)."""
    t0 = build.process_start_time() if t0 is None else t0
    build.check_flow(config)
    run_dir = build.make_run_dir(config)
    task = build.build_task(config)
    graphdef, params = build.init_params(config, task)
    buffer, weights = build.make_buffer(config), build.make_weights(config)
    metrics = Metrics()
    stop = threading.Event()
    evaluator = Evaluator(config, task, graphdef, weights, metrics, t0)
    eval_every = config.run.eval_every

    def on_step(step: int, version: int, _: dict) -> None:
        if eval_every and step % eval_every == 0:
            evaluator.requests.put((step, version))

    learner = Learner(config, graphdef, params, buffer, weights, metrics, stop, on_step,
                      task.sampler_settings.allowed_mask(task.dims.vocab_size))
    learner.publish()  # version 0, before any actor starts
    workers = [Worker("learner", learner.run, stop),
               Worker("evaluator", lambda: evaluator.run(stop), stop)]
    for i in range(config.actor.num_actors):
        actor = Actor(config, f"actor-{i}", task.make_env, task.tokenizer,
                      build.make_sampler(config, task, graphdef, seed=config.run.seed + 100 + i),
                      buffer, weights, metrics, stop)
        workers.append(Worker(f"actor-{i}", actor.run, stop))
    sinks = [JsonlSink(run_dir / "metrics.jsonl"), TensorBoardSink(run_dir / "tensorboard")]
    view = LiveView(f"headrace train {config.env.name}", enabled=live)
    for worker in workers:
        worker.start()
    stopped_by = "unknown"
    last_logged = -1
    try:
        while True:
            if stop.wait(0.5):
                stopped_by = "error"
                break
            snapshot = {**metrics.snapshot(), **buffer.stats()}
            step = learner.step
            if step // config.run.log_every != last_logged // config.run.log_every:
                for sink in sinks:
                    sink.write(step, snapshot)
                last_logged = step
            view.update(snapshot, time.time() - t0)
            if learner.done.is_set():
                stopped_by = "max_steps"
                break
            if config.run.max_wall_s and time.time() - t0 >= config.run.max_wall_s:
                stopped_by = "max_wall_s"
                break
            if config.run.stop_at_target and evaluator.reached.is_set():
                stopped_by = "target"
                break
    except KeyboardInterrupt:
        stopped_by = "interrupted"
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=30)
        view.close()
    errors = [f"{w.name}: {type(w.error).__name__}: {w.error}" for w in workers if w.error]
    final = evaluator.evaluate_version(learner.step, weights.latest_version())
    snapshot = {**metrics.snapshot(), **buffer.stats()}
    for sink in sinks:
        sink.write(learner.step, snapshot)
        sink.close()
    summary = {
        "final_success_rate": final["success_rate"],
        "time_to_target_s": evaluator.time_to_target_s,
        "learner_utilization": learner.utilization,
        "steps": learner.step,
        "episodes": int(snapshot.get("actor/episodes", 0)),
        "wall_s": round(time.time() - t0, 2),
        "stopped_by": stopped_by,
        "errors": errors,
        "run_dir": str(run_dir),
        "eval_curve": evaluator.curve,
    }
    build.write_json(pathlib.Path(run_dir) / "summary.json", summary)
    return summary
