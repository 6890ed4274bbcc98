"""Warm starts: `model.init_from: RUN_DIR` (see `headrace.sft`)."""

from __future__ import annotations

import dataclasses
import logging
import pathlib

from headrace.config import Config, ConfigError, LearnerConfig, LossConfig

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
SFT_KIND = "sft"


def sft_learner_config(config: Config) -> LearnerConfig:
    """The learner settings the warm-up trains with (negative log-likelihood, one update/step)."""
    return dataclasses.replace(
        config.learner, groups_per_batch=config.sft.batch_size, minibatches=1,
        loss=LossConfig(kind="none"), kl_coef=0.0, entropy_coef=0.0, loss_agg="token_mean",
        optimizer=dataclasses.replace(config.learner.optimizer, lr=config.sft.lr))


# Sizes a config fixes by itself (the vocabulary also depends on the environment and template).
_SIZE_KEYS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "dtype")


def _source(config: Config) -> tuple[pathlib.Path, Config]:
    """The `model.init_from` folder and its config, checked (see `check_init_from`)."""
    from headrace.config import load

    raw = config.model.init_from
    key = f"model.init_from={raw!r}"
    path = pathlib.Path(raw)
    if not path.is_dir():
        raise ConfigError(f"{key}: no such folder; give the run folder of a `headrace sft` or "
                          "`headrace train` run")
    if not (path / "config.yaml").is_file():
        raise ConfigError(f"{key}: not a run folder (no config.yaml)")
    checkpoints = path / CHECKPOINT_DIR
    if not checkpoints.is_dir() or not any(p.name.isdigit() for p in checkpoints.iterdir()):
        raise ConfigError(f"{key}: holds no checkpoint ({CHECKPOINT_DIR}/ is missing or empty); "
                          "did that run finish?")
    try:
        source = load(path / "config.yaml")
    except ConfigError as error:
        raise ConfigError(f"{key}: its config.yaml does not load: {error}") from None
    return path, source


def check_init_from(config: Config, dims) -> None:
    """Checks, without reading any array, that `model.init_from` can warm-start this model.

    Raises:
      ConfigError: no such folder, not a run folder, no checkpoint, or another model size or chat
        template than this run's (the message names the difference).
    """
    from headrace.runtime.checkpoint import Checkpointer

    path, source = _source(config)
    key = f"model.init_from={config.model.init_from!r}"
    if source.text.template != config.text.template:
        raise ConfigError(f"{key}: that run rendered episodes with text.template="
                          f"{source.text.template!r}, this one with {config.text.template!r}; "
                          "use the same template")
    with Checkpointer(path / CHECKPOINT_DIR) as checkpointer:
        metadata = checkpointer.read_metadata()
    # A warm-up records its exact dims; a training run's vocabulary is checked when restoring.
    theirs = metadata.get("dims") or {k: getattr(source.model, k) for k in _SIZE_KEYS}
    ours = dataclasses.asdict(dims)
    different = {k: (theirs[k], ours[k]) for k in theirs if k in ours and theirs[k] != ours[k]}
    if different:
        text = ", ".join(f"{k} {a} there, {b} here" for k, (a, b) in different.items())
        raise ConfigError(f"{key}: that run's model differs from this one ({text}); use the "
                          "same model and environment settings")


def load_init_params(config: Config, dims):
    """(graphdef, params) from the newest checkpoint of `model.init_from` (see the docstring).

    Raises:
      ConfigError: as `check_init_from`, or the checkpoint does not fit this model.
    """
    import jax

    from headrace.learner.train_step import init_state, make_optimizer
    from headrace.model import params as params_lib
    from headrace.runtime.checkpoint import Checkpointer

    check_init_from(config, dims)
    path, source = _source(config)
    graphdef = params_lib.graphdef(dims)
    with Checkpointer(path / CHECKPOINT_DIR) as checkpointer:
        step = checkpointer.latest_step()
        kind = checkpointer.read_metadata(step).get("kind")
        learner = sft_learner_config(source) if kind == SFT_KIND else source.learner
        optimizer = make_optimizer(learner.optimizer)

        def fresh():
            return init_state(params_lib.init(dims, 0)[1], optimizer, learner.kl_coef)

        abstract = jax.eval_shape(fresh)
        try:
            state, _ = checkpointer.restore(abstract, step)
        except ValueError as error:
            raise ConfigError(f"model.init_from={config.model.init_from!r}: its checkpoint does "
                              f"not fit this model: {error}") from None
    log.info("model.init_from: starting from %s (checkpoint %s)", path, step)
    return graphdef, state.params
