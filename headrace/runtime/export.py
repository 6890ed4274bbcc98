"""Checkpoints out: `headrace export RUN_DIR|RUN_DIR/checkpoints/STEP --hf OUT [--dtype D]`.

Writes a Hugging Face folder that `transformers.AutoModelForCausalLM.from_pretrained` (and so vLLM)
loads with the same logits: config.json, model.safetensors (float32 or bfloat16) and, when the
run started from a checkpoint with a tokenizer, its tokenizer files (a GGUF's embedded tokenizer
is written as tokenizer.json + tokenizer_config.json with its chat template). Names and layouts
come from `headrace.formats.hf.name_table`, the table import uses; a tied model stores
`model.embed_tokens.weight` only (vLLM reads an aliased `lm_head.weight` as zeros). A run of the
project's own models exports as a llama config (its word/byte tokenizer has no tokenizer.json
form: the folder then holds the model only, and says so in the log).

A LoRA run (`model.lora`) exports its adapters in PEFT's format: adapter_config.json and
adapter_model.safetensors (`base_model.model.<HF module>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r], module names from the same name table), which
`peft.PeftModel.from_pretrained(transformers base, OUT)` loads. The adapter's base is the run's
`hf:DIR` when it started from one; otherwise (GGUF, a run folder, fresh weights) the base is
exported too, to OUT/base, and the adapter points there. With `merge` (`--merge`) the run exports
as any other: full weights, W + (alpha / r) * B @ A, that transformers loads alone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import shutil
from typing import Any

import numpy as np

from headrace.config import Config, ConfigError
from headrace.formats import checkpoint_kind, hf, peft, resolve
from headrace.model import lora
from headrace.model import params as params_lib
from headrace.model.dims import ModelDims
from headrace.rundir import RunDir

log = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def export_params(dims: ModelDims, params: Any, out: str | pathlib.Path, *,
                  family: str = "llama", dtype: str = "float32", max_len: int = 0,
                  extra_config: dict | None = None) -> pathlib.Path:
    """Writes `params` of a model `dims` as a Hugging Face `family` folder `out`.

    A deliberate device->host copy of the parameters (one tensor at a time is converted).

    Raises:
      CheckpointError: the model cannot be expressed as `family`, or an unknown dtype.
    """
    spec = vars(dims)
    config = hf.config_from_spec(spec, family, max_len, extra_config)
    flat = params_lib.flatten(params)
    tensors = {}
    for name, ours, transposed in hf.name_table(spec):
        array = np.asarray(flat[ours])  # device -> host (intended)
        tensors[name] = array.T if transposed else array
    return hf.write(out, config, tensors, dtype)


def export_adapter(dims: ModelDims, adapters: Any, spec: lora.LoraSpec,
                   out: str | pathlib.Path, base: str, dtype: str = "float32") -> pathlib.Path:
    """Writes a PEFT LoRA adapter (adapter_config.json, adapter_model.safetensors) of the adapter
    tree `adapters` for the base model folder `base` into `out` (`formats.peft.write_adapter`;
    a deliberate device->host copy).

    Raises:
      CheckpointError: an unknown dtype.
    """
    return peft.write_adapter(out, vars(dims), params_lib.flatten(adapters), rank=spec.rank,
                              alpha=spec.alpha, targets=spec.targets, base=base, dtype=dtype)


def _run_and_step(target: pathlib.Path) -> tuple[pathlib.Path, int | None]:
    if target.parent.name == RunDir.CHECKPOINTS and target.name.isdigit():
        return target.parent.parent, int(target.name)
    return target, None


def _copy_text(source: str, out: pathlib.Path) -> list[str]:
    """The source checkpoint's tokenizer files into `out`; returns their names."""
    kind, path = resolve(source)
    if kind == "hf":
        copied = []
        for name in TOKENIZER_FILES:
            if (path / name).is_file():
                shutil.copyfile(path / name, out / name)
                copied.append(name)
        return copied
    from headrace.formats import gguf
    from headrace.text.hf_tokenizer import gguf_tokenizer

    tokenizer = gguf_tokenizer(gguf.read(path))
    tokenizer._markup.save(str(out / "tokenizer.json"))
    config = {k: v for k, v in tokenizer.tokens.items() if v is not None}
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json"]


def export_run(target: str | pathlib.Path, out: str | pathlib.Path, dtype: str = "float32",
               merge: bool = False) -> dict[str, Any]:
    """Exports the newest checkpoint of run folder `target` (or the one `target` names,
    RUN_DIR/checkpoints/STEP) to `out`. Returns a summary (out, step, family, files; for a LoRA
    run exported as an adapter also adapter and base). A LoRA run writes a PEFT adapter unless
    `merge` (see the module docstring).

    Raises:
      ConfigError: not a run folder, no such checkpoint, or a model that cannot be exported.
    """
    from headrace.config import load
    from headrace.runtime.build import build_task
    from headrace.sft import load_init_params

    run_dir, step = _run_and_step(pathlib.Path(target))
    if not (run_dir / RunDir.CONFIG).is_file():
        raise ConfigError(f"{target}: not a run folder (no config.yaml) nor RUN_DIR/checkpoints/"
                          "STEP")
    if not (run_dir / RunDir.CHECKPOINTS).is_dir():
        raise ConfigError(f"{run_dir}: holds no checkpoints/ (did the run save one?)")
    source: Config = load(run_dir / RunDir.CONFIG)
    task = build_task(source)
    config = dataclasses.replace(source, model=dataclasses.replace(source.model,
                                                                   init_from=str(run_dir)))
    if step is None:
        from headrace.learner.checkpoint import Checkpointer

        with Checkpointer(run_dir / RunDir.CHECKPOINTS) as checkpointer:
            step = checkpointer.latest_step()
    spec = lora.LoraSpec.of(source.model.lora)
    if spec is not None and not merge:
        return _export_lora(source, task.dims, run_dir, step, out, dtype, spec)
    _, params = load_init_params(config, task.dims, step=step)
    origin = source.model.init_from
    family, max_len, extra = _family(source)
    out = export_params(task.dims, params, out, family=family, dtype=dtype, max_len=max_len,
                        extra_config=extra)
    files = _copy_text(origin, out) if checkpoint_kind(origin) else []
    if not files:
        log.warning("export: %s has no tokenizer.json form (the project's own tokenizer); "
                    "%s holds the model only", run_dir, out)
    return {"out": str(out), "run": str(run_dir), "step": step, "family": family,
            "dtype": dtype, "files": sorted(p.name for p in pathlib.Path(out).iterdir())}


def _export_lora(source: Config, dims: ModelDims, run_dir: pathlib.Path, step: int | None,
                 out: str | pathlib.Path, dtype: str, spec: lora.LoraSpec) -> dict[str, Any]:
    """A LoRA run's checkpoint as a PEFT adapter (and, without an hf: base, the base too)."""
    from headrace.sft.warm_start import restore_params

    try:
        adapters, step = restore_params(run_dir / RunDir.CHECKPOINTS, source, dims, step,
                                        adapters_only=True)
    except FileNotFoundError as error:
        raise ConfigError(f"{run_dir}: {error}") from None
    except ValueError as error:
        raise ConfigError(f"{run_dir}: its checkpoint does not fit its config's model.lora: "
                          f"{error}") from None
    out = pathlib.Path(out)
    origin = source.model.init_from
    kind, where = resolve(origin) if checkpoint_kind(origin) else (None, None)
    summary: dict[str, Any] = {"out": str(out), "run": str(run_dir), "step": step,
                               "dtype": dtype, "adapter": True}
    if kind == "hf":
        base = str(pathlib.Path(where).resolve())
        summary["family"] = _open_config(origin)["model_type"]
    else:  # the base has no Hugging Face folder of its own: write one beside the adapter
        base_out = out / "base"
        base_summary = export_run_base(source, dims, base_out, dtype)
        base = str(base_out.resolve())
        summary["family"] = base_summary["family"]
    export_adapter(dims, adapters, spec, out, base, dtype)
    summary["base"] = base
    summary["files"] = sorted(p.name for p in out.iterdir())
    return summary


def _open_config(origin: str) -> dict:
    from headrace.model.dims import open_checkpoint

    return open_checkpoint(origin)[2]


def _family(source: Config) -> tuple[str, int, dict]:
    """(family, max_len, token ids) to export a run of config `source` as: its checkpoint's, or
    llama for the project's own models."""
    origin = source.model.init_from
    if not checkpoint_kind(origin):
        return "llama", source.model.max_len, {}
    config = _open_config(origin)
    extra = {k: config[k] for k in _TOKEN_IDS if config.get(k) is not None}
    return config["model_type"], hf.max_len(config) or source.model.max_len, extra


def export_run_base(source: Config, dims: ModelDims, out: pathlib.Path, dtype: str
                    ) -> dict[str, Any]:
    """The frozen base of a LoRA run made with config `source` as a Hugging Face folder."""
    from headrace.sft import load_init_params

    origin = source.model.init_from
    if origin:
        params = load_init_params(source, dims)[1]
    else:
        params = params_lib.init(dims, source.run.seed)[1]
    family, max_len, extra = _family(source)
    export_params(dims, params, out, family=family, dtype=dtype, max_len=max_len,
                  extra_config=extra)
    if checkpoint_kind(origin):
        _copy_text(origin, out)
    return {"family": family}
