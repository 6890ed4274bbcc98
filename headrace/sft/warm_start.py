"""Warm starts: `model.init_from: RUN_DIR` (see `headrace.sft`), or a checkpoint,
`model.init_from: hf:DIR | gguf:FILE | gguf:pkg:PACKAGE/PATH` (`headrace.model.load`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib

from headrace.config import Config, ConfigError, LearnerConfig, LossConfig
from headrace.rundir import RunDir
from headrace.text.template import template_name

log = logging.getLogger(__name__)

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
    if not (path / RunDir.CONFIG).is_file():
        raise ConfigError(f"{key}: not a run folder (no config.yaml)")
    checkpoints = path / RunDir.CHECKPOINTS
    if not checkpoints.is_dir() or not any(p.name.isdigit() for p in checkpoints.iterdir()):
        raise ConfigError(f"{key}: holds no checkpoint ({RunDir.CHECKPOINTS}/ is missing or empty); "
                          "did that run finish?")
    try:
        source = load(path / RunDir.CONFIG)
    except ConfigError as error:
        raise ConfigError(f"{key}: its config.yaml does not load: {error}") from None
    return path, source


def check_init_from(config: Config, dims) -> None:
    """Checks, without reading any array, that `model.init_from` can warm-start this model.

    Raises:
      ConfigError: no such folder, not a run folder, no checkpoint, or another model size or chat
        template than this run's (the message names the difference).
    """
    from headrace.formats import checkpoint_kind, resolve
    from headrace.learner.checkpoint import Checkpointer

    if checkpoint_kind(config.model.init_from):  # its dims are the checkpoint's (from_config)
        resolve(config.model.init_from)
        return
    path, source = _source(config)
    key = f"model.init_from={config.model.init_from!r}"
    theirs, ours = (template_name(c.text, c.model.init_from) for c in (source, config))
    if theirs != ours:
        raise ConfigError(f"{key}: that run rendered episodes with text.template="
                          f"{theirs!r}, this one with {ours!r}; use the same template")
    with Checkpointer(path / RunDir.CHECKPOINTS, read_only=True) as checkpointer:
        metadata = checkpointer.read_metadata()
    # A warm-up records its exact dims; a training run's vocabulary is checked when restoring.
    theirs = metadata.get("dims") or {k: getattr(source.model, k) for k in _SIZE_KEYS}
    ours = json.loads(json.dumps(dataclasses.asdict(dims)))  # as the metadata stores it
    different = {k: (theirs[k], ours[k]) for k in theirs if k in ours and theirs[k] != ours[k]}
    if different:
        text = ", ".join(f"{k} {a} there, {b} here" for k, (a, b) in different.items())
        raise ConfigError(f"{key}: that run's model differs from this one ({text}); use the "
                          "same model and environment settings")


def load_init_params(config: Config, dims, step: int | None = None):
    """(graphdef, params) from `model.init_from`: a Hugging Face or GGUF checkpoint, or the
    newest checkpoint of a run folder (or its checkpoint `step`; see the docstring).

    Raises:
      ConfigError: as `check_init_from`, no such checkpoint, or it does not fit this model.
    """
    from headrace.formats import checkpoint_kind
    from headrace.model import params as params_lib

    check_init_from(config, dims)
    graphdef = params_lib.graphdef(dims)
    key = f"model.init_from={config.model.init_from!r}"
    if checkpoint_kind(config.model.init_from):
        from headrace.model.load import load

        loaded = load(config.model.init_from, dtype=dims.dtype, with_text=False,
                      shardings=_mesh_shardings(config, dims))
        if loaded.dims != dims:
            raise ConfigError(f"{key}: the checkpoint's model {loaded.dims} differs from this "
                              f"run's {dims}")
        log.info("model.init_from: starting from checkpoint %s", config.model.init_from)
        return graphdef, loaded.params
    path, source = _source(config)
    try:
        params, step = restore_params(path / RunDir.CHECKPOINTS, source, dims, step)
    except FileNotFoundError as error:
        raise ConfigError(f"{key}: {error}") from None
    except ValueError as error:
        raise ConfigError(f"{key}: its checkpoint does not fit this model: {error}") from None
    log.info("model.init_from: starting from %s (checkpoint %s)", path, step)
    return graphdef, params


def restore_params(checkpoints: pathlib.Path, source: Config, dims, step: int | None = None,
                   adapters_only: bool = False):
    """(params, step): the policy parameters of checkpoint `step` (default: the newest) in the
    folder `checkpoints` of a run made with config `source` (a warm-up's or a training run's).

    A LoRA run (`source.model.lora`) checkpoints its adapters only: the parameters returned are
    its base (rebuilt from `source`: its `model.init_from`, or its seed) with the adapters merged
    in, or with `adapters_only` the adapter tree itself (master dtype).

    Raises:
      FileNotFoundError: no such checkpoint (the message lists those kept).
      ValueError: the checkpoint does not fit a model of `dims`.
    """
    import jax

    from headrace.learner.checkpoint import Checkpointer
    from headrace.learner.train_step import init_state, make_optimizer
    from headrace.model import lora
    from headrace.model import params as params_lib

    spec = lora.LoraSpec.of(source.model.lora)

    with Checkpointer(checkpoints, read_only=True) as checkpointer:
        step = checkpointer.latest_step() if step is None else step
        if step is None or step not in checkpointer.all_steps():
            raise FileNotFoundError(f"no checkpoint {step} in {checkpoints} (kept: "
                                    f"{checkpointer.all_steps()})")
        kind = checkpointer.read_metadata(step).get("kind")
        learner = sft_learner_config(source) if kind == SFT_KIND else source.learner
        optimizer = make_optimizer(learner.optimizer)

        def fresh():
            params = params_lib.init(dims, 0)[1]
            trainable = params if spec is None or kind == SFT_KIND else lora.init(params, spec, 0)
            return init_state(trainable, optimizer, learner.kl_coef)

        state, _ = checkpointer.restore(jax.eval_shape(fresh), step)
    if spec is None or kind == SFT_KIND or adapters_only:
        return state.params, step
    if source.model.init_from:
        base = load_init_params(source, dims)[1]
    else:
        base = params_lib.init(dims, source.run.seed)[1]
    return lora.merge(base, state.params, spec), step


def _mesh_shardings(config: Config, dims):
    """{param path: NamedSharding} of the learner's mesh (`parallel.mesh`), so a checkpoint's
    tensors are placed straight onto their shards (the sharded step then keeps them where they
    are); None on one device or with several learner processes (placed by the step)."""
    import jax

    if not config.parallel.sharded or jax.process_count() > 1:
        return None
    from jax.sharding import NamedSharding

    from headrace.model import params as params_lib
    from headrace.parallel import rules
    from headrace.parallel.mesh import make_mesh

    mesh = make_mesh(config.parallel.mesh)
    if mesh.size == 1:
        return None
    abstract = jax.eval_shape(lambda: params_lib.init(dims, 0)[1])
    plan = rules.plan_params(abstract, mesh, config.parallel.rules)
    return {path: NamedSharding(mesh, item.spec) for path, item in plan.items()}
