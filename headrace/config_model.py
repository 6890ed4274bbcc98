"""The model's section of the run's config (`headrace.config.Config` holds it): sizes or a
preset, dtype, remat, the checkpoint to start from, and LoRA adapters. Every field has a one-line
doc; ranges are checked in `__post_init__`, each failure a `ConfigError` naming the key."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from headrace.configtree import ConfigError, _check

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # headrace's projection names


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    # LoRA adapters (Hu et al. 2021): rank 0 trains every parameter; rank r >= 1 freezes the base
    # and trains adapters A [in, r], B [r, out] on `targets`, publishing the adapters only.
    rank: int = 0
    alpha: float = 16.0  # the adapters' scale is alpha / rank
    targets: tuple[str, ...] = LORA_TARGETS  # projections that get adapters (of LORA_TARGETS)

    def __post_init__(self):
        _check(self.rank >= 0, "model.lora.rank", self.rank, "must be >= 0 (0: no adapters)")
        _check(self.alpha > 0, "model.lora.alpha", self.alpha, "must be > 0")
        _check(bool(self.targets), "model.lora.targets", list(self.targets),
               f"must name at least one of {list(LORA_TARGETS)}")
        for target in self.targets:
            _check(target in LORA_TARGETS, "model.lora.targets", list(self.targets),
                   f"{target!r} is not a projection; choose from {list(LORA_TARGETS)}")
        _check(len(set(self.targets)) == len(self.targets), "model.lora.targets",
               list(self.targets), "names a projection twice")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    preset: Literal["tiny", "small", "custom"] = "tiny"  # sets d_model..d_ff unless custom
    vocab_size: int = 0  # 0: the tokenizer's vocabulary size
    d_model: int = 64  # residual width
    n_layers: int = 2  # transformer blocks
    n_heads: int = 4  # query heads
    n_kv_heads: int = 2  # key/value heads (grouped-query attention)
    d_ff: int = 128  # SwiGLU hidden width
    max_len: int = 4096  # longest sequence (RoPE table size)
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute (and published weights') dtype
    # block: each transformer block under jax.checkpoint in the learner (keeps only its input for
    # the backward pass, recomputes the rest); none: keeps every intermediate (faster, more memory);
    # auto: block on a mesh of more than one device, none on one device
    remat: Literal["auto", "none", "block"] = "auto"
    # Start from these weights: a run folder (headrace sft or train), hf:DIR (a Hugging Face
    # folder), gguf:FILE or gguf:pkg:PACKAGE/PATH; a checkpoint also sets every size above.
    init_from: str = ""
    lora: LoraConfig = LoraConfig()  # low-rank adapters: train (and publish) these only

    def __post_init__(self):
        for key in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_len"):
            _check(getattr(self, key) >= 1, f"model.{key}", getattr(self, key), "must be >= 1")
        _check(self.vocab_size >= 0, "model.vocab_size", self.vocab_size, "must be >= 0")
        _check(self.d_model % self.n_heads == 0, "model.n_heads", self.n_heads,
               f"must divide model.d_model={self.d_model}")
        _check((self.d_model // self.n_heads) % 2 == 0, "model.n_heads", self.n_heads,
               "head size d_model/n_heads must be even (RoPE)")
        _check(self.n_heads % self.n_kv_heads == 0, "model.n_kv_heads", self.n_kv_heads,
               f"must divide model.n_heads={self.n_heads}")

    @staticmethod
    def complete(kwargs: dict[str, Any], prefix: str) -> dict[str, Any]:
        """The given keys plus the preset's sizes not given (`configtree.build` calls it).

        Raises:
          ConfigError: a size given beside a checkpoint, which sets them all.
        """
        _check_checkpoint_sizes(kwargs, prefix)
        preset = MODEL_PRESETS.get(kwargs.get("preset", "tiny"), {})
        return {**{k: v for k, v in preset.items() if k not in kwargs}, **kwargs}


# Keys a checkpoint (`model.init_from: hf:DIR | gguf:FILE`) fixes by itself.
CHECKPOINT_SIZE_KEYS = ("preset", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                        "d_ff", "max_len")


def _check_checkpoint_sizes(kwargs: dict[str, Any], prefix: str) -> None:
    """With a checkpoint, dims, vocabulary and max_len come from it: a size also given (other than
    its default) is refused, naming the key."""
    source = str(kwargs.get("init_from", ""))
    if source.partition(":")[0] not in ("hf", "gguf") or ":" not in source:
        return
    defaults = ModelConfig()
    for key in CHECKPOINT_SIZE_KEYS:
        if key in kwargs and kwargs[key] != getattr(defaults, key):
            raise ConfigError(f"{prefix}.{key}={kwargs[key]!r}: {prefix}.init_from={source!r} is "
                              f"a checkpoint, whose config sets the model's sizes; remove "
                              f"{prefix}.{key}")


MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128),
    "small": dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=1024),
}
