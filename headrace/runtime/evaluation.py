"""`headrace eval RUN_DIR|CHECKPOINT [--episodes N] [--json]`: how well a trained policy does.

What is evaluated:

- `RUN_DIR` (a run folder: it holds `config.yaml`): the newest weights the run published
  (`RUN_DIR/weights`, or `weights.path`), the policy its own final evaluation played; when it
  published none to disk (the threads launcher with `weights.backend: memory`), its newest
  checkpoint.
- `RUN_DIR/checkpoints/STEP`: the policy parameters of that checkpoint (of a training run or of a
  `headrace sft` warm-up).

The run's own `config.yaml` rebuilds the environment, the tokenizer, the model and the sampling
settings. The policy plays the held-out tasks (`headrace.actor.evaluate.eval_seeds`: the
environment's own evaluation set, or `--episodes` of them; else `--episodes` seeds, 64 by default,
that no actor plays) twice: greedily, and sampling as the actors do (the run's temperature, top-k
and top-p; the random stream seeded by `run.seed`). A progress bar goes to stderr.

It only reads: a run still training can be evaluated (checkpoints are opened read-only; a weights
version pruned while it is read is replaced by the newest). A path that is none of the above, a
run folder with nothing to evaluate, or a checkpoint that does not fit the run's model is an
`EvalError` whose message says what to give instead.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time
from typing import Any

from headrace import config as config_lib
from headrace.actor.evaluate import eval_seeds, evaluate
from headrace.config import Config, ConfigError
from headrace.env.base import EnvError
from headrace.model import params as params_lib
from headrace.rundir import RunDir
from headrace.runtime import build
from headrace.weights.base import VersionGone

DEFAULT_EPISODES = 64  # held-out tasks when the environment has no evaluation set of its own
USAGE = (f"give a run folder (RUN_DIR, holding config.yaml) or one of its checkpoints "
         f"(RUN_DIR/{RunDir.CHECKPOINTS}/STEP)")


class EvalError(Exception):
    """The path cannot be evaluated; the message says why and what to give instead."""


@dataclasses.dataclass(frozen=True)
class Target:
    """What `headrace eval` was pointed at."""

    run_dir: pathlib.Path
    checkpoint_step: int | None  # None: the run's newest published weights (or checkpoint)


def locate(path: str | pathlib.Path) -> Target:
    """Classifies `path` as a run folder or one of its checkpoints.

    Raises:
      EvalError: neither (or nothing there).
    """
    p = pathlib.Path(path)
    if not p.exists():
        raise EvalError(f"{path}: no such file or folder; {USAGE}")
    if not p.is_dir():
        raise EvalError(f"{path}: not a folder; {USAGE}")
    if (p / RunDir.CONFIG).is_file():
        return Target(p, None)
    if p.name.isdigit() and p.parent.name == RunDir.CHECKPOINTS:
        if (p.parent.parent / RunDir.CONFIG).is_file():
            return Target(p.parent.parent, int(p.name))
        raise EvalError(f"{path}: a checkpoint outside a run folder ({p.parent.parent} holds no "
                        f"config.yaml, which says what model and environment it is for); {USAGE}")
    raise EvalError(f"{path}: neither a run folder (no config.yaml) nor a checkpoint; {USAGE}")


def load_run_config(run_dir: pathlib.Path) -> Config:
    """The run's config, as it trained (a warm start's source is not needed any more).

    Raises:
      EvalError: config.yaml does not load.
    """
    try:
        config = config_lib.load(run_dir / RunDir.CONFIG)
        if config.model.lora.rank:  # its published adapters need the base it trained over
            return config
        return config_lib.replace(config, model={"init_from": ""})
    except ConfigError as error:
        raise EvalError(f"{run_dir / 'config.yaml'} does not load: {error}") from None


def _published(config: Config, run_dir: pathlib.Path):
    """(flat params, version) of the newest weights on disk, or None when there are none."""
    from headrace.weights.directory import DirWeightStore

    root = pathlib.Path(config.weights.path) if config.weights.path else run_dir / RunDir.WEIGHTS
    if not (root / "LATEST").is_file():
        return None
    store = DirWeightStore(root, keep=1)  # reading only: a store never prunes on load
    for _ in range(3):  # a live run may prune the version between the pointer and the files
        version = store.latest_version()
        try:
            return store.load(version), version
        except VersionGone:
            continue
    raise EvalError(f"{root}: the newest weights were pruned three times while being read; "
                    "try again")


def _checkpoint(config: Config, run_dir: pathlib.Path, dims, step: int | None):
    """(params, step, learner step or None) of checkpoint `step` (None: the newest)."""
    from headrace.learner.checkpoint import Checkpointer
    from headrace.sft.warm_start import restore_params

    folder = run_dir / RunDir.CHECKPOINTS
    try:
        params, step = restore_params(folder, config, dims, step)
        with Checkpointer(folder, read_only=True) as checkpointer:
            learner_step = checkpointer.read_metadata(step).get("learner_step")
    except FileNotFoundError as error:
        raise EvalError(f"{error}; {USAGE}") from None
    except ValueError as error:
        raise EvalError(f"checkpoint {step} in {folder} does not fit the model of "
                        f"{run_dir / 'config.yaml'}: {error}") from None
    return params, step, learner_step


def _has_checkpoint(run_dir: pathlib.Path) -> bool:
    folder = run_dir / RunDir.CHECKPOINTS
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def run(path: str | pathlib.Path, episodes: int | None = None,
        progress: bool = True) -> dict[str, Any]:
    """Evaluates what `path` names (see the module docstring); returns the results.

    Args:
      episodes: held-out tasks to play in each mode (None: the environment's whole evaluation
        set, or DEFAULT_EPISODES).
      progress: show a progress bar on stderr.

    Raises:
      EvalError: see the module docstring (also for a config or environment that does not build).
    """
    if episodes is not None and episodes < 1:
        raise EvalError(f"--episodes {episodes}: must be >= 1")
    start = time.time()
    target = locate(path)
    config = load_run_config(target.run_dir)
    try:
        task = build.build_task(config)
    except (ConfigError, EnvError) as error:
        raise EvalError(f"{target.run_dir / 'config.yaml'}: {error}") from None
    graphdef = params_lib.graphdef(task.dims)
    version = learner_step = checkpoint_step = None
    published = None if target.checkpoint_step is not None else _published(config,
                                                                            target.run_dir)
    if published is not None:
        flat, version = published
        try:
            params = build.weights_loader(config, task)(flat)
        except (KeyError, ValueError, TypeError) as error:
            raise EvalError(f"weights version {version} of {target.run_dir} do not fit the "
                            f"model of its config.yaml: {error}") from None
    elif target.checkpoint_step is not None or _has_checkpoint(target.run_dir):
        params, checkpoint_step, learner_step = _checkpoint(config, target.run_dir, task.dims,
                                                            target.checkpoint_step)
    else:
        raise EvalError(f"{target.run_dir}: holds neither published weights (weights/) nor a "
                        f"checkpoint ({RunDir.CHECKPOINTS}/); a run of the threads launcher with "
                        "weights.backend memory keeps none: train with run.launcher processes "
                        "or weights.backend dir")
    sampler = build.make_sampler(config, task, graphdef, seed=config.run.seed + 7)
    sampler.set_params(params, version if version is not None else checkpoint_step)
    probe = task.make_env()
    try:
        own = callable(getattr(probe, "eval_seeds", None))
        seeds = eval_seeds(probe, episodes or DEFAULT_EPISODES)
    finally:
        probe.close()
    if own and episodes is not None:
        seeds = seeds[:episodes]
    results = {}
    with _Bar(progress, len(seeds)) as bar:
        for mode in ("greedy", "sampled"):
            bar.begin(mode)
            results[mode] = evaluate(task.make_env, task.tokenizer, sampler, seeds,
                                     config.env.step_timeout_s, config.actor.max_batch,
                                     greedy=mode == "greedy", on_episode=bar.advance)
    return {
        "source": str(path),
        "run_dir": str(target.run_dir),
        "weights_version": version,
        "checkpoint_step": checkpoint_step,
        "learner_step": learner_step,
        "env": config.env.name,
        "tasks": len(seeds),
        **{f"{mode}_{key}": value for mode, result in results.items()
           for key, value in result.items()},
        "wall_s": round(time.time() - start, 2),
    }


class _Bar:
    """One progress bar per mode on stderr (rich); does nothing when disabled."""

    def __init__(self, enabled: bool, total: int):
        self.total = total
        self._progress = None
        self._task = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                      MofNCompleteColumn(), console=Console(file=sys.stderr))

    def __enter__(self) -> _Bar:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def begin(self, mode: str) -> None:
        if self._progress is not None:
            self._task = self._progress.add_task(f"{mode} episodes", total=self.total)

    def advance(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)


def untrained_success(config: Config, eval_size: int,
                      task: build.Task | None = None) -> tuple[float, list[int]]:
    """Greedy success of the model as the config initialises it (its checkpoint, or random) on
    the env's evaluation seeds (`eval_seeds(env, eval_size)`); blocking. `task`: the config's,
    if the caller built it already. Returns the rate and the seeds."""
    task = task or build.build_task(config)
    graphdef, params = build.init_params(config, task)
    sampler = build.make_sampler(config, task, graphdef, seed=0)
    sampler.set_params(params, 0)
    probe = task.make_env()
    try:
        seeds = eval_seeds(probe, eval_size)
    finally:
        probe.close()
    rate = evaluate(task.make_env, task.tokenizer, sampler, seeds, config.env.step_timeout_s,
                    config.actor.max_batch)["success_rate"]
    return rate, seeds
