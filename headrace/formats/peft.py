"""LoRA adapters as PEFT writes them (no JAX): what `headrace export` writes for a LoRA run and
what the vLLM engine hands its server for each published version.

A headrace adapter's flat wire form is `layers.<i>.<attn|mlp>.<proj>.lora_a` [in, r] and
`.lora_b` [r, out] (`headrace.model.lora`); PEFT's is `base_model.model.<HF module>.lora_A.weight`
[r, in] and `.lora_B.weight` [out, r], with module names from `hf.name_table` (the table import
and export use), plus an adapter_config.json that `peft.PeftModel.from_pretrained` and vLLM's
`/v1/load_lora_adapter` read.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from headrace.formats import hf

LORA_A, LORA_B = "lora_a", "lora_b"  # the wire's key suffixes
HF_MODULE = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
             "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
             "down": "mlp.down_proj"}
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


class AdapterError(ValueError):
    """Weights that are not this model's adapters (wrong keys or shapes)."""


def is_adapters(flat: Mapping[str, Any]) -> bool:
    """Whether a flat weights mapping holds adapters (its keys end in lora_a / lora_b)."""
    return bool(flat) and all(k.endswith((LORA_A, LORA_B)) for k in flat)


def check(flat: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], where: str) -> None:
    """Raises AdapterError unless `flat` holds exactly the `expected` adapter keys and shapes
    (`headrace.model.lora.shapes`)."""
    if not is_adapters(flat):
        raise AdapterError(f"{where}: holds full weights, not model.lora adapters (was it "
                           "published by a run without model.lora?)")
    missing, extra = sorted(set(expected) - set(flat)), sorted(set(flat) - set(expected))
    if missing or extra:
        raise AdapterError(f"{where}: adapter keys differ from model.lora's (missing "
                           f"{missing[:3]}, unexpected {extra[:3]}); the run's model.lora "
                           "targets or the model changed")
    for key, shape in expected.items():
        if tuple(flat[key].shape) != shape:
            rank = shape[0] if key.endswith(LORA_B) else shape[1]
            raise AdapterError(f"{where}: {key} has shape {tuple(flat[key].shape)}, model.lora "
                               f"expects {shape} (rank {rank})")


def adapter_tensors(spec: Mapping[str, Any], flat: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """PEFT's tensors of flat adapters `flat` for a model `spec` (`ModelDims` fields):
    {base_model.model.<module>.lora_A.weight: [r, in], .lora_B.weight: [out, r]}.
    (A device array in `flat` is copied to the host, deliberately.)"""
    tensors = {}
    for name, ours, _ in hf.name_table(spec):
        path = ours.removesuffix(".kernel")
        if f"{path}.{LORA_A}" not in flat:
            continue
        module = f"base_model.model.{name.removesuffix('.weight')}"
        tensors[f"{module}.lora_A.weight"] = np.asarray(flat[f"{path}.{LORA_A}"]).T
        tensors[f"{module}.lora_B.weight"] = np.asarray(flat[f"{path}.{LORA_B}"]).T
    return tensors


def write_adapter(out: str | pathlib.Path, spec: Mapping[str, Any], flat: Mapping[str, Any], *,
                  rank: int, alpha: float, targets: Sequence[str], base: str,
                  dtype: str = "float32") -> pathlib.Path:
    """Writes a PEFT LoRA adapter (adapter_config.json, adapter_model.safetensors) of the flat
    adapters `flat` for the base model folder `base` into `out` (made if missing).

    Raises:
      CheckpointError: an unknown dtype.
    """
    out = pathlib.Path(out)
    hf.save_tensors(out / WEIGHTS, adapter_tensors(spec, flat), dtype)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
              "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
              "target_modules": sorted(HF_MODULE[t].split(".")[1] for t in targets),
              "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
              "use_rslora": False, "use_dora": False, "modules_to_save": None,
              "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out
