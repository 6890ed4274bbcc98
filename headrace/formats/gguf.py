"""GGUF checkpoints read as "an HF-style config dict + tensors named as Hugging Face names them"
(JAX-free: numpy and the `gguf` package).

    checkpoint = read("model.gguf")            # metadata only: the file is memory-mapped
    checkpoint.config["hidden_size"]           # 576: shaped like the config.json transformers writes
    w = checkpoint.tensors["model.layers.0.self_attn.q_proj.weight"]   # float32 [out, in]
    checkpoint.chat_template, checkpoint.metadata("tokenizer.ggml.pre")
    hf_tokenizer.gguf_tokenizer(checkpoint)    # its tokenizer (headrace.text, which imports this)

`tensors` is a lazy Mapping: each lookup dequantizes that one tensor from the memory-mapped file
(nothing is cached, so a caller that places tensors one by one never holds more than one in host
memory besides its own copies). llama.cpp stores the query and key rows permuted for its rope (the
two halves of every head interleaved); lookups undo that, so the arrays are exactly what Hugging
Face's `LlamaForCausalLM` holds (transformers' own GGUF loader does the same reverse permutation;
tests/text/test_gguf.py compares every tensor).

Only the `llama` architecture is read (Llama, SmolLM2, Mistral-style dense models converted by
llama.cpp). Any other architecture, rope scaling, or a tensor this reader does not know is one
`GGUFError` naming it, never a silent default.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor name (the part after blk.N.) -> Hugging Face's name in a Llama layer
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


class GGUFError(ValueError):
    """A GGUF file headrace cannot read: the message names the file and what is unsupported."""


def _value(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    if match and match[2] in _LAYER_NAMES:
        return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}"
    return None


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation: within each head its rows were reordered from
    (half, pair) to (pair, half) so rope rotates adjacent pairs; Hugging Face rotates halves.
    Works on weights [rows, in] and biases [rows]."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(reader, path: pathlib.Path, names: set[str]) -> dict[str, Any]:
    """The config.json transformers would write for this file (transformers 5 field names)."""
    arch = _value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported (headrace reads "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)}); convert the model to a Hugging "
                        "Face folder and load it with model.init_from: hf:DIR")

    def get(key: str, default: Any = None) -> Any:
        value = _value(reader, f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{path}: metadata {arch}.{key} is missing")
        return value

    scaling = _value(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") or "rope_freqs.weight" in names:
        raise GGUFError(f"{path}: rope scaling ({arch}.rope.scaling.type={scaling!r}, or a "
                        "rope_freqs.weight tensor) is not implemented for GGUF files; load the "
                        "Hugging Face folder instead (model.init_from: hf:DIR)")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(_value(reader, f"{arch}.attention.key_length", hidden // heads))
    rotary = int(_value(reader, f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise GGUFError(f"{path}: partial rotary embeddings ({arch}.rope.dimension_count={rotary}, "
                        f"head_dim {head_dim}) are not implemented")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(_value(reader, f"{arch}.vocab_size", len(tokens.data) if tokens else 0))
    theta = float(get("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
    }
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id")):
        value = _value(reader, f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[hf_key] = int(value)
    return config


class _LazyTensors(Mapping):
    """HF name -> float32 array, dequantized on each lookup (see the module docstring)."""

    def __init__(self, reader, config: dict[str, Any], path: pathlib.Path):
        self._path = path
        self._by_name = {}
        for tensor in reader.tensors:
            name = _hf_name(tensor.name)
            if name is None:
                raise GGUFError(f"{path}: tensor {tensor.name!r} is not one headrace knows for "
                                f"the {config['model_type']} architecture")
            self._by_name[name] = tensor
        self._heads = {"q_proj": config["num_attention_heads"],
                       "k_proj": config["num_key_value_heads"]}

    def __getitem__(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        tensor = self._by_name[name]
        w = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32)
        w = w.reshape(self.shape(name))
        for proj, heads in self._heads.items():
            if f".self_attn.{proj}." in name:
                w = unpermute_rope_rows(w, heads)
        return w

    def shape(self, name: str) -> tuple[int, ...]:
        """The HF shape of a tensor ([out, in] for weights) without reading it."""
        return tuple(int(n) for n in reversed(self._by_name[name].shape))

    def quantization(self, name: str) -> str:
        """The GGUF storage type of a tensor (F32, Q8_0, Q4_1, ...)."""
        return self._by_name[name].tensor_type.name

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)


@dataclasses.dataclass
class GGUFCheckpoint:
    """One GGUF file: `config` (config.json-shaped dict), `tensors` (lazy HF-named float32
    arrays), `tokenizer` and `chat_template` (built on first use)."""

    path: pathlib.Path
    config: dict[str, Any]
    tensors: _LazyTensors
    _reader: Any = dataclasses.field(repr=False)

    @property
    def chat_template(self) -> str | None:
        """The embedded Jinja chat template (`tokenizer.chat_template`), or None."""
        value = _value(self._reader, "tokenizer.chat_template")
        return str(value) if value else None

    def metadata(self, key: str, default: Any = None) -> Any:
        """A raw metadata value (e.g. `tokenizer.ggml.token_type`)."""
        return _value(self._reader, key, default)


def package_path(spec: str) -> pathlib.Path:
    """`pkg:PACKAGE/FILE` -> the file inside an installed package (found without importing the
    package, whose `__init__` may need what is not installed); any other text is a plain path.

    Raises:
      GGUFError: no such package installed.
    """
    if not spec.startswith("pkg:"):
        return pathlib.Path(spec)
    package, _, rest = spec[len("pkg:"):].partition("/")
    found = importlib.util.find_spec(package) if package else None
    if found is None or not found.submodule_search_locations:
        raise GGUFError(f"{spec!r}: no installed package {package!r} (pkg:PACKAGE/FILE names a "
                        "file inside an installed Python package)")
    return pathlib.Path(list(found.submodule_search_locations)[0]) / rest


def read(path: str | pathlib.Path) -> GGUFCheckpoint:
    """Opens a GGUF file, a path or `pkg:PACKAGE/FILE` (memory-mapped; reads metadata, no tensor
    data).

    Raises:
      GGUFError: the file does not exist, is not GGUF, or has an architecture, rope scaling or
        tensor headrace does not read (the message names it).
    """
    from gguf import GGUFReader

    path = package_path(str(path))
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as error:
        raise GGUFError(f"{path}: not a readable GGUF file ({error})") from None
    names = {t.name for t in reader.tensors}
    config = _config(reader, path, names)
    return GGUFCheckpoint(path, config, _LazyTensors(reader, config, path), reader)
