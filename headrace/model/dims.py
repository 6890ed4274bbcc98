"""The model's spec: every size and every switch that changes the math (no JAX).

`ModelDims` is hashable (a static argument of jitted functions). Its defaults are the project's
own Llama-style models (the `tiny`/`small` presets); a checkpoint's `config.json` sets the rest
(`headrace.formats.hf.dims_from_config`), so one set of fields covers Llama 2/3, SmolLM2, Mistral,
Qwen2/2.5, Qwen3 and Gemma 2/3 without per-size tables.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from headrace.config import ModelConfig

FULL, SLIDING = "full", "sliding"
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A rotary-frequency rescaling (`rope_scaling` / `rope_parameters` in config.json).

    kind "linear": every frequency divided by `factor` (position interpolation, Chen et al. 2023).
    kind "llama3": Llama 3.1's band-wise rule: wavelengths past `original_max_len /
    low_freq_factor` divided by `factor`, those under `original_max_len / high_freq_factor` kept,
    a smooth blend between.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """Resolved sizes and switches (the vocabulary comes from the tokenizer or the checkpoint).

    Per layer `layer_types[i]` is FULL (attends to every earlier position) or SLIDING (to the last
    `sliding_window` positions, rotary base `rope_local_theta` without scaling when that is set);
    an empty tuple means every layer is FULL.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    dtype: str = "float32"
    head_size: int = 0  # 0: d_model // n_heads
    norm_eps: float = 1e-6  # RMSNorm epsilon
    norm_offset: bool = False  # RMSNorm scales by (1 + w) (Gemma), else by w
    rope_theta: float = 10000.0  # rotary base of FULL layers
    rope_scaling: RopeScaling | None = None  # of FULL layers
    rope_local_theta: float = 0.0  # rotary base of SLIDING layers (0: as FULL layers)
    qkv_bias: bool = False  # q, k and v projections have biases (Qwen2)
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    sandwich_norm: bool = False  # norms after attention and feed-forward too (Gemma 2/3)
    tie_embeddings: bool = False  # logits use the embedding table (no unembed parameter)
    embed_scale: bool = False  # embeddings times sqrt(d_model) (Gemma)
    activation: str = "silu"  # gated feed-forward's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    attn_softcap: float = 0.0  # attention scores -> cap * tanh(scores / cap) (0: off)
    final_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) (0: off)
    query_scale: float = 0.0  # scores scaled by query_scale ** -0.5 (0: head_dim)
    sliding_window: int = 0  # keys a SLIDING layer's query sees (itself included)
    layer_types: tuple[str, ...] = ()

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ModelDims.activation={self.activation!r}: one of {ACTIVATIONS}")
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError(f"ModelDims.layer_types has {len(self.layer_types)} entries for "
                             f"{self.n_layers} layers")
        if any(t not in (FULL, SLIDING) for t in self.layer_types):
            raise ValueError(f"ModelDims.layer_types={self.layer_types}: each {FULL!r} or "
                             f"{SLIDING!r}")
        if SLIDING in self.layer_types and self.sliding_window < 1:
            raise ValueError("ModelDims: sliding layers need sliding_window >= 1")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        return (self.query_scale or self.head_dim) ** -0.5

    def layer_type(self, index: int) -> str:
        return self.layer_types[index] if self.layer_types else FULL

    def inv_freq(self, layer_type: str = FULL) -> np.ndarray:
        """float32[head_dim / 2] rotary frequencies of a layer of this type, computed as Hugging
        Face computes them (float32 powers) so positions rotate by the same angles."""
        local = layer_type == SLIDING and self.rope_local_theta
        base = self.rope_local_theta if local else self.rope_theta
        e = self.head_dim
        inv = (1.0 / (np.float32(base) ** (np.arange(0, e, 2, dtype=np.float32) / np.float32(e))))
        scaling = None if local else self.rope_scaling
        if scaling is None:
            return inv.astype(np.float32)
        if scaling.kind == "linear":
            return (inv / np.float32(scaling.factor)).astype(np.float32)
        low_wavelen = scaling.original_max_len / scaling.low_freq_factor
        high_wavelen = scaling.original_max_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = ((scaling.original_max_len / wavelen - scaling.low_freq_factor)
                  / (scaling.high_freq_factor - scaling.low_freq_factor))
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, blended, scaled).astype(np.float32)

    @classmethod
    def from_config(cls, config: ModelConfig, vocab_size: int) -> ModelDims:
        """The dims `config.model` asks for: a checkpoint's own (`init_from: hf:DIR | gguf:FILE`,
        in the dtype `model.dtype` names), else the configured sizes.

        Raises:
          ConfigError: a checkpoint that cannot be read or holds an unsupported model.
        """
        from headrace.formats import checkpoint_kind

        if checkpoint_kind(config.init_from):
            return dataclasses.replace(read_dims(config.init_from), dtype=config.dtype)
        return cls(vocab_size=config.vocab_size or vocab_size, d_model=config.d_model,
                   n_layers=config.n_layers, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
                   d_ff=config.d_ff, dtype=config.dtype)


def dims_from_spec(spec: Mapping[str, Any], dtype: str = "float32") -> ModelDims:
    """`ModelDims` from `hf.spec_from_config`'s dict."""
    fields = dict(spec)
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    return ModelDims(**fields, dtype=dtype)


def open_checkpoint(spec: str):
    """(kind, path, config dict, checkpoint: `hf.SafetensorsCheckpoint` or `gguf.GGUFCheckpoint`)."""
    from headrace.formats import hf, resolve

    kind, path = resolve(spec)
    if kind == "hf":
        checkpoint = hf.SafetensorsCheckpoint(path)
        return kind, path, checkpoint.config, checkpoint
    from headrace.formats import gguf

    try:
        checkpoint = gguf.read(path)
    except gguf.GGUFError as error:
        raise hf.CheckpointError(str(error)) from None
    return kind, path, checkpoint.config, checkpoint


def read_dims(spec: str, dtype: str = "float32") -> ModelDims:
    """The dims of the checkpoint `spec` names (reads its config only, no tensor).

    Raises:
      ConfigError: as `headrace.model.load.load` (CheckpointError is one).
    """
    from headrace.formats import hf

    _, path, config, _ = open_checkpoint(spec)
    return dims_from_spec(hf.spec_from_config(config, f"{spec}: config"), dtype)
