"""What every launcher shares: periodic greedy evaluation, the report-and-watch loop, the summary.

The loop writes metrics to the sinks, refreshes the live view and ends the run on the first stop
condition: the learner finished (`run.max_steps`), `run.max_wall_s`, `run.max_train_s`, the
evaluation target reached (`run.stop_at_target`), a worker's failure, or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from headrace.actor.evaluate import eval_seeds, evaluate
from headrace.audit.hint import sizing_hint
from headrace.config import Config
from headrace.metrics.core import Metrics
from headrace.metrics.sinks import JsonlSink, LiveView, TensorBoardSink
from headrace.rundir import RunDir
from headrace.runtime import build
from headrace.weights.base import VersionGone, WeightStore
from headrace.weights.memory import MemoryWeightStore

log = logging.getLogger(__name__)


class Evaluator:
    """Greedy evaluation of the learner's weights at exact steps, on its own thread (never the
    learner's).

    Periodic points: the learner pins the weights of every step that is a multiple of
    `run.eval_every` (before `run.max_steps`) in `pins`, keyed by the step; the watch loop polls
    for new pins (`maybe_request`, every half second) and this thread evaluates them, so every
    point of the curve is the policy of exactly its step, however far the learner has moved on.
    When the evaluator falls behind it evaluates the newest pin (the ones skipped are not
    evaluated); a pin pruned before it was read is skipped with a warning. A request still
    queued when the run stops is evaluated by `drain` before the final one, so stopping loses no
    evaluation point. The final evaluation (`finish`) is of the last published weights, at the
    last step. One evaluation runs at a time (the sampler is shared).
    """

    def __init__(self, config: Config, task: build.Task, graphdef, weights: WeightStore,
                 metrics: Metrics, t0: float, episodes: Callable[[], float],
                 pins: WeightStore | None = None):
        """`pins`: the store the learner pins evaluation points in (`build.make_pins`); None:
        no periodic evaluation, only the final one."""
        self.config = config
        self.task = task
        self.weights = weights
        self.pins = pins if pins is not None else MemoryWeightStore(1)  # None: stays empty
        self.metrics = metrics
        self.t0 = t0
        self.episodes = episodes
        self.sampler = build.make_sampler(config, task, graphdef, seed=config.run.seed + 7)
        self._loader = None  # published weights -> params (a LoRA base loads on first use)
        probe = task.make_env()
        self.seeds = eval_seeds(probe, 64)
        probe.close()
        self.requests: queue.Queue[int] = queue.Queue()
        self.curve: list[dict[str, float]] = []
        self.time_to_target_s: float | None = None
        self.reached = threading.Event()
        # Pins already there belong to an earlier start of this run (a resume): not evaluated.
        self._last_pin = self.pins.latest_version()
        self._lock = threading.Lock()

    def maybe_request(self, step: int) -> None:
        """Queues the newest pinned evaluation point, if the learner pinned one since the last
        call and it is before the last step (`step`: the learner's step now)."""
        last = self.config.run.max_steps
        if last and step >= last:  # the learner is finishing: the final evaluation covers it
            return
        pinned = self.pins.latest_version()
        if pinned > self._last_pin:
            self._last_pin = pinned
            self.requests.put(pinned)

    def evaluate_pin(self, step: int) -> dict[str, float]:
        """Evaluates the weights pinned at learner step `step`.

        Raises:
          VersionGone: the pin was pruned (the evaluator fell behind by PINS_KEPT points).
        """
        return self._evaluate(step, self.pins.load(step))

    def evaluate_version(self, step: int, version: int) -> dict[str, float]:
        """Evaluates published weights `version`, recorded at learner step `step`."""
        return self._evaluate(step, self.weights.load(version))

    def _evaluate(self, step: int, flat) -> dict[str, float]:
        with self._lock:
            if self._loader is None:
                self._loader = build.weights_loader(self.config, self.task)
            self.sampler.set_params(self._loader(flat), step)
            result = evaluate(self.task.make_env, self.task.tokenizer, self.sampler, self.seeds,
                              self.config.env.step_timeout_s, self.config.actor.max_batch)
            wall = time.time() - self.t0
            self.curve.append({"wall_s": round(wall, 2), "step": step,
                               "episodes": self.episodes(),
                               "success_rate": result["success_rate"]})
        self.metrics.gauge("eval/success_rate", result["success_rate"])
        if result["success_rate"] >= self.config.run.eval_target and self.time_to_target_s is None:
            self.time_to_target_s = wall
            self.reached.set()
        log.info("eval step %d: success %.3f at %.1f s", step, result["success_rate"], wall)
        return result

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                step = self.requests.get(timeout=0.1)
            except queue.Empty:
                continue
            while not self.requests.empty():  # fall behind gracefully: evaluate the newest
                step = self.requests.get_nowait()
            try:
                self.evaluate_pin(step)
            except VersionGone:
                log.warning("eval step %d: its pinned weights were pruned before evaluation",
                            step)

    def drain(self, before_step: int) -> None:
        """Evaluates the newest pin not yet evaluated if its step is before `before_step` (the
        final evaluation's); called once the run has stopped and `run` has returned."""
        self.maybe_request(0)  # a pin made since the last poll of the watch loop
        pending = None
        while not self.requests.empty():
            pending = self.requests.get_nowait()
        if pending is not None and pending < before_step:
            try:
                self.evaluate_pin(pending)
            except VersionGone:
                log.warning("eval step %d: its pinned weights were pruned before evaluation",
                            pending)


class Background:
    """A daemon thread running `fn(stop_event)`, stopped and joined by `stop()`; an exception
    that ends it is kept in `error` (for the launcher to report) and logged."""

    def __init__(self, name: str, fn: Callable[[threading.Event], None]):
        self._stop = threading.Event()
        self.error: BaseException | None = None

        def run(stop: threading.Event) -> None:
            try:
                fn(stop)
            except Exception as error:
                log.exception("%s failed", name)
                self.error = error

        self._thread = threading.Thread(target=run, args=(self._stop,), name=name, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)


def start_thread(name: str, fn: Callable[[threading.Event], None]) -> Background:
    return Background(name, fn)


class Reporter:
    """metrics.jsonl + TensorBoard + the live view, fed from one merged snapshot."""

    def __init__(self, config: Config, run_dir: pathlib.Path, live: bool):
        self.config = config
        self.sinks = [JsonlSink(run_dir / RunDir.METRICS),
                      TensorBoardSink(run_dir / RunDir.TENSORBOARD)]
        self.view = LiveView(f"headrace train {config.env.name}", enabled=live)
        self._last_step = -1

    def report(self, step: int, snapshot: dict[str, float], elapsed_s: float,
               force: bool = False) -> None:
        every = self.config.run.log_every
        if force or step // every != self._last_step // every:
            for sink in self.sinks:
                sink.write(step, snapshot)
            self._last_step = step
        self.view.update(snapshot, elapsed_s, hint=sizing_hint(snapshot, self.config))

    def close(self) -> None:
        self.view.close()
        for sink in self.sinks:
            sink.close()


@contextlib.contextmanager
def ctrl_c_sets(event: threading.Event):
    """Within it, Ctrl-C (SIGINT) sets `event` instead of raising KeyboardInterrupt wherever the
    main thread happens to be (inside a lock, a Redis reply or a child's start, any of which it
    would leave half done); a second Ctrl-C raises as usual. Off the main thread, where no
    handler can be installed, Ctrl-C raises as usual."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if event.is_set():
            raise KeyboardInterrupt
        event.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:  # None: a handler not installed from Python, which cannot be put back
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)


def watch(config: Config, t0: float, *, snapshot: Callable[[], dict[str, float]],
          reporter: Reporter, evaluator: Evaluator, failed: Callable[[], bool],
          finished: Callable[[], bool], tick: Callable[[], None] = lambda: None) -> str:
    """Reports every half second until a stop condition; returns which one stopped the run
    (Ctrl-C is read at the next tick: "interrupted")."""
    trained_since = None  # when the first trained step was seen (run.max_train_s counts from it)
    interrupted = threading.Event()
    try:
        with ctrl_c_sets(interrupted):
            while not interrupted.wait(0.5):
                tick()
                current = snapshot()
                step = int(current.get("learner/step", 0))
                reporter.report(step, current, time.time() - t0)
                if trained_since is None and step >= 1:
                    trained_since = time.time()
                if failed():
                    return "error"
                if finished():
                    return "max_steps"
                if config.run.max_wall_s and time.time() - t0 >= config.run.max_wall_s:
                    return "max_wall_s"
                if (config.run.max_train_s and trained_since is not None
                        and time.time() - trained_since >= config.run.max_train_s):
                    return "max_train_s"
                if config.run.stop_at_target and evaluator.reached.is_set():
                    return "target"
                evaluator.maybe_request(step)  # not at the stop: the final evaluation covers it
            return "interrupted"
    except KeyboardInterrupt:  # a second Ctrl-C, or off the main thread
        return "interrupted"


def finish(run_dir: pathlib.Path, t0: float, evaluator: Evaluator, reporter: Reporter,
           snapshot: dict[str, float], stopped_by: str, errors: list[str]) -> dict[str, Any]:
    """Final greedy evaluation of the last weights, last metrics record, summary.json.

    A failed run is reported at once: no final evaluation (minutes for a real model, of weights
    that may be version 0); its `final_success_rate` is the last periodic point, or None."""
    step = int(snapshot.get("learner/step", 0))
    evaluator.drain(step)
    final_success: float | None
    if stopped_by == "error":
        log.warning("the run failed: no final evaluation")
        final_success = evaluator.curve[-1]["success_rate"] if evaluator.curve else None
    else:
        final = evaluator.evaluate_version(step, evaluator.weights.latest_version())
        final_success = final["success_rate"]
        snapshot = {**snapshot, "eval/success_rate": final_success}
    reporter.report(step, snapshot, time.time() - t0, force=True)
    reporter.close()
    summary = {
        "final_success_rate": final_success,
        "time_to_target_s": evaluator.time_to_target_s,
        "learner_utilization": snapshot.get("learner/utilization", 0.0),
        "steps": step,
        "episodes": int(snapshot.get("actor/episodes", 0)),
        "wall_s": round(time.time() - t0, 2),
        "stopped_by": stopped_by,
        "errors": errors,
        "run_dir": str(run_dir),
        "eval_curve": evaluator.curve,
    }
    build.write_json(run_dir / RunDir.SUMMARY, summary)
    return summary
