"""Hugging Face checkpoints (no JAX): config.json -> a validated model spec, the name table between
Hugging Face tensor names and headrace parameter paths, a memory-mapped safetensors reader and a
safetensors writer.

- `spec_from_config(config)` reads every config.json field that changes the math into a dict of
  `headrace.model.dims.ModelDims` fields. Families: llama (Llama 2/3.x, SmolLM2), mistral, qwen2,
  qwen3, gemma, gemma2, gemma3_text. An unknown architecture, a field whose value headrace does not
  implement (a rope type, attention biases where the family has none, sliding windows where it
  has none, dropout) or a field it does not know is one `CheckpointError` naming the field.
- `name_table(spec)` lists (HF name, headrace path, transposed): linear weights are [out, in] in
  Hugging Face and kernels [in, out] in headrace; everything else keeps its layout. The same
  table serves import, export and anything else that maps names (it needs no JAX).
- `SafetensorsCheckpoint(folder)`: `tensors` is a lazy Mapping over one model.safetensors or the
  shards a model.safetensors.index.json lists; a lookup (or `read(name, index)`) maps that one
  tensor's bytes, copies them (or the block `index` selects) and unmaps them.
- `write(folder, config, tensors, dtype)`: config.json and model.safetensors that
  `transformers.AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import json
import mmap
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from headrace.config import ConfigError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
_GEMMA = ("gemma", "gemma2", "gemma3_text")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                  "gemma3_text": "Gemma3ForCausalLM"}
# Fields that do not change the forward pass (bookkeeping, generation defaults, token ids).
_HARMLESS = {
    "_name_or_path", "architectures", "bos_token_id", "chunk_size_feed_forward", "dtype",
    "torch_dtype", "eos_token_id", "id2label", "initializer_range", "is_encoder_decoder",
    "label2id", "model_type", "output_attentions", "output_hidden_states", "pad_token_id",
    "unk_token_id", "problem_type", "return_dict", "transformers_version", "use_cache",
    "max_window_layers", "pretraining_tp", "cache_implementation", "final_norm",
    "tie_word_embeddings", "max_position_embeddings", "vocab_size", "_sliding_window_pattern",
    "sliding_window_pattern", "use_bidirectional_attention", "attn_implementation",
    "tokenizer_class", "generation_config", "bos_token", "eos_token",
}
_SIZES = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "intermediate_size", "rms_norm_eps", "hidden_act", "hidden_activation"}
_ROPE = {"rope_theta", "rope_scaling", "rope_parameters", "rope_local_base_freq"}
_FAMILY_FIELDS = {
    "llama": {"attention_bias", "mlp_bias", "attention_dropout"},
    "mistral": {"attention_dropout", "sliding_window"},
    "qwen2": {"attention_dropout", "use_sliding_window", "sliding_window", "layer_types"},
    "qwen3": {"attention_bias", "attention_dropout", "use_sliding_window", "sliding_window",
              "layer_types"},
    "gemma": {"attention_bias", "attention_dropout"},
    "gemma2": {"attention_bias", "attention_dropout", "query_pre_attn_scalar", "sliding_window",
               "layer_types", "attn_logit_softcapping", "final_logit_softcapping"},
    "gemma3_text": {"attention_bias", "attention_dropout", "query_pre_attn_scalar",
                    "sliding_window", "layer_types", "attn_logit_softcapping",
                    "final_logit_softcapping"},
}


class CheckpointError(ConfigError):
    """A checkpoint headrace cannot read or write: the message names the file and the field or
    tensor, and what to do."""


# --- config.json -> spec ----------------------------------------------------------------------

def _rope(config: dict, where: str, kind: str) -> dict[str, Any]:
    """{rope_theta, rope_scaling, rope_local_theta} from rope_parameters (transformers 5) or
    rope_theta / rope_scaling / rope_local_base_freq (transformers 4)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full, local = params.get("full_attention") or {}, params.get("sliding_attention")
    else:
        full = dict(params or config.get("rope_scaling") or {})
        full.setdefault("rope_theta", config.get("rope_theta", 10000.0))
        local = ({"rope_theta": config["rope_local_base_freq"]}
                 if config.get("rope_local_base_freq") else None)
    out = {"rope_theta": float(full.get("rope_theta", config.get("rope_theta", 10000.0))),
           "rope_scaling": _scaling(full, f"{where}: rope_parameters"), "rope_local_theta": 0.0}
    if local is not None:
        if _scaling(local, f"{where}: rope_parameters.sliding_attention") is not None:
            raise CheckpointError(f"{where}: rope scaling of sliding layers is not implemented")
        out["rope_local_theta"] = float(local.get("rope_theta", 10000.0))
    elif kind == "gemma3_text":
        out["rope_local_theta"] = 10000.0  # Gemma 3's default local base
    return out


def _scaling(params: dict, where: str) -> dict[str, Any] | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return {"kind": "linear", "factor": float(params["factor"])}
    if kind == "llama3":
        try:
            return {"kind": "llama3", "factor": float(params["factor"]),
                    "low_freq_factor": float(params["low_freq_factor"]),
                    "high_freq_factor": float(params["high_freq_factor"]),
                    "original_max_len": int(params["original_max_position_embeddings"])}
        except KeyError as missing:
            raise CheckpointError(f"{where}: llama3 rope scaling without {missing}") from None
    raise CheckpointError(f"{where}: rope_type {kind!r} is not implemented (headrace has "
                          "default, linear and llama3)")


def _activation(config: dict, where: str, kind: str) -> str:
    name = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if kind == "gemma" and not config.get("hidden_activation"):
        name = "gelu_pytorch_tanh"  # transformers runs Gemma 1 with the tanh approximation
    if name == "silu":
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise CheckpointError(f"{where}: activation {name!r} is not implemented (silu, "
                          "gelu_pytorch_tanh)")


def _layer_types(config: dict, where: str, kind: str, n_layers: int) -> tuple[str, ...]:
    window = config.get("sliding_window")
    if kind in ("qwen2", "qwen3"):
        if config.get("use_sliding_window"):
            raise CheckpointError(f"{where}: use_sliding_window=true is not implemented for "
                                  f"{kind}")
        return ()
    if kind == "mistral":
        return ("sliding",) * n_layers if window else ()
    if kind not in ("gemma2", "gemma3_text"):
        return ()
    types = config.get("layer_types")
    if types is None:
        pattern = (2 if kind == "gemma2" else
                   int(config.get("sliding_window_pattern",
                                  config.get("_sliding_window_pattern", 6))))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(n_layers)]
    if len(types) != n_layers or any(t not in ("full_attention", "sliding_attention")
                                     for t in types):
        raise CheckpointError(f"{where}: layer_types={types}: {n_layers} entries of "
                              "full_attention / sliding_attention")
    if "sliding_attention" in types and not window:
        raise CheckpointError(f"{where}: sliding layers without a sliding_window")
    return tuple("sliding" if t == "sliding_attention" else "full" for t in types)


def spec_from_config(config: dict, where: str = "config.json") -> dict[str, Any]:
    """`ModelDims` fields (a dict; `rope_scaling` a dict or None) for a config.json.

    Raises:
      CheckpointError: an unsupported model_type or field value, or an unknown field.
    """
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise CheckpointError(f"{where}: model_type {kind!r} is not supported (headrace reads "
                              f"{', '.join(FAMILIES)})")
    known = _HARMLESS | _SIZES | _ROPE | _FAMILY_FIELDS[kind]
    unknown = sorted(k for k in config if k not in known)
    if unknown:
        raise CheckpointError(f"{where}: field(s) {', '.join(unknown)} of a {kind} config are "
                              "not implemented (they may change the model's math)")
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field):
            raise CheckpointError(f"{where}: {field}=true is not implemented for {kind} (only "
                                  "qwen2's q/k/v biases are)")
    if config.get("attention_dropout"):
        raise CheckpointError(f"{where}: attention_dropout={config['attention_dropout']} is not "
                              "implemented (set it to 0.0)")
    try:
        d, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        spec: dict[str, Any] = {
            "vocab_size": int(config["vocab_size"]), "d_model": d,
            "n_layers": int(config["num_hidden_layers"]), "n_heads": heads,
            "n_kv_heads": int(config.get("num_key_value_heads") or heads),
            "d_ff": int(config["intermediate_size"]),
            "head_size": int(config.get("head_dim") or d // heads),
            "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        }
    except KeyError as missing:
        raise CheckpointError(f"{where}: {missing} is missing") from None
    gemma = kind in _GEMMA
    spec.update(_rope(config, where, kind))
    spec.update(
        norm_offset=gemma, qkv_bias=kind == "qwen2", qk_norm=kind in ("qwen3", "gemma3_text"),
        sandwich_norm=kind in ("gemma2", "gemma3_text"),
        tie_embeddings=bool(config.get("tie_word_embeddings", gemma)), embed_scale=gemma,
        activation=_activation(config, where, kind),
        attn_softcap=float(config.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(config.get("final_logit_softcapping") or 0.0),
        query_scale=float(config.get("query_pre_attn_scalar") or 0.0),
        layer_types=_layer_types(config, where, kind, spec["n_layers"]))
    spec["sliding_window"] = int(config.get("sliding_window") or 0) if spec["layer_types"] else 0
    if spec["head_size"] % 2:
        raise CheckpointError(f"{where}: head_dim {spec['head_size']} is odd (RoPE needs pairs)")
    if heads % spec["n_kv_heads"]:
        raise CheckpointError(f"{where}: num_key_value_heads {spec['n_kv_heads']} does not "
                              f"divide num_attention_heads {heads}")
    return spec


def max_len(config: dict) -> int:
    """The longest sequence the checkpoint was made for (max_position_embeddings)."""
    return int(config.get("max_position_embeddings") or 0)


# --- the name table -------------------------------------------------------------------------------

def name_table(spec: Mapping[str, Any]) -> list[tuple[str, str, bool]]:
    """(Hugging Face name, headrace path, transposed) for every parameter of a model `spec`
    (`ModelDims` fields, as a dict or the dataclass's `__dict__`)."""
    table = [("model.embed_tokens.weight", "embed.embedding", False)]
    post_attention = "attn_post_norm" if spec["sandwich_norm"] else "mlp_norm"
    for i in range(spec["n_layers"]):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        table += [(f"{hf}input_layernorm.weight", f"{ours}attn_norm.scale", False),
                  (f"{hf}post_attention_layernorm.weight", f"{ours}{post_attention}.scale",
                   False)]
        if spec["sandwich_norm"]:
            table += [(f"{hf}pre_feedforward_layernorm.weight", f"{ours}mlp_norm.scale", False),
                      (f"{hf}post_feedforward_layernorm.weight", f"{ours}mlp_post_norm.scale",
                       False)]
        for proj in "qkvo":
            table.append((f"{hf}self_attn.{proj}_proj.weight", f"{ours}attn.{proj}.kernel", True))
        if spec["qkv_bias"]:
            table += [(f"{hf}self_attn.{p}_proj.bias", f"{ours}attn.{p}.bias", False)
                      for p in "qkv"]
        if spec["qk_norm"]:
            table += [(f"{hf}self_attn.{p}_norm.weight", f"{ours}attn.{p}_norm.scale", False)
                      for p in "qk"]
        table += [(f"{hf}mlp.{p}_proj.weight", f"{ours}mlp.{p}.kernel", True)
                  for p in ("gate", "up", "down")]
    table.append(("model.norm.weight", "final_norm.scale", False))
    if not spec["tie_embeddings"]:
        table.append(("lm_head.weight", "unembed.kernel", True))
    return table


def config_from_spec(spec: Mapping[str, Any], family: str = "llama", max_len: int = 0,
                     extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A config.json for `spec` (`ModelDims` fields) as `family` (export; the project's own models
    are llama-shaped). `extra` adds fields (token ids, the source's bookkeeping).

    Raises:
      CheckpointError: the spec uses a switch the family does not have.
    """
    if family not in FAMILIES:
        raise CheckpointError(f"export as {family!r}: not a family headrace writes")
    spec = {**spec, "head_size": spec["head_size"] or spec["d_model"] // spec["n_heads"]}
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[family]], "model_type": family,
        "vocab_size": spec["vocab_size"], "hidden_size": spec["d_model"],
        "num_hidden_layers": spec["n_layers"], "num_attention_heads": spec["n_heads"],
        "num_key_value_heads": spec["n_kv_heads"], "intermediate_size": spec["d_ff"],
        "head_dim": spec["head_size"] or spec["d_model"] // spec["n_heads"],
        "rms_norm_eps": spec["norm_eps"], "max_position_embeddings": max_len or 4096,
        "tie_word_embeddings": spec["tie_embeddings"], "attention_dropout": 0.0,
    }
    config["hidden_activation" if family in _GEMMA else "hidden_act"] = (
        "gelu_pytorch_tanh" if spec["activation"] == "gelu_tanh" else "silu")
    scaling = spec["rope_scaling"]
    scaling = scaling if isinstance(scaling, Mapping) or scaling is None else vars(scaling)
    full = {"rope_type": "default", "rope_theta": spec["rope_theta"]}
    if scaling:
        full = {"rope_theta": spec["rope_theta"], "rope_type": scaling["kind"],
                "factor": scaling["factor"]}
        if scaling["kind"] == "llama3":
            full.update(low_freq_factor=scaling["low_freq_factor"],
                        high_freq_factor=scaling["high_freq_factor"],
                        original_max_position_embeddings=scaling["original_max_len"])
    if family == "gemma3_text":
        config["rope_parameters"] = {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": spec["rope_local_theta"] or 10000.0}}
    else:
        config["rope_parameters"] = full
    if family in ("gemma2", "gemma3_text"):
        scalar = spec["query_scale"] or config["head_dim"]
        config.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                      attn_logit_softcapping=spec["attn_softcap"] or None,
                      final_logit_softcapping=spec["final_softcap"] or None,
                      sliding_window=spec["sliding_window"] or None,
                      layer_types=[f"{t}_attention" for t in spec["layer_types"]] or None)
    elif spec["layer_types"]:
        if family != "mistral":
            raise CheckpointError(f"export as {family}: sliding-window layers need mistral or "
                                  "gemma2/gemma3_text")
        config["sliding_window"] = spec["sliding_window"]
    config.update(extra or {})
    back = spec_from_config(config, f"export as {family}")
    differs = sorted(k for k in back if k in spec and not _same(back[k], spec[k]))
    if differs:
        raise CheckpointError(f"export as {family}: the model's {', '.join(differs)} cannot be "
                              f"expressed in a {family} config")
    return config


def _same(read_back: Any, ours: Any) -> bool:
    """A config's value equals the model's (a rope scaling: in the fields its kind has)."""
    if ours is not None and not isinstance(ours, (int, float, str, bool, dict, tuple, list)):
        ours = vars(ours)  # RopeScaling
    if isinstance(read_back, dict) and isinstance(ours, dict):
        return all(_same(v, ours.get(k)) for k, v in read_back.items())
    return json.loads(json.dumps(read_back)) == json.loads(json.dumps(ours))


# --- safetensors --------------------------------------------------------------------------------

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


CHUNK_BYTES = 4 << 20  # copied per step while reading a tensor
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


class SafetensorsCheckpoint:
    """A Hugging Face folder: `config` (config.json) and `tensors` (lazy, memory-mapped).

    Each safetensors file's header (8 bytes of length, then JSON: name -> dtype, shape, byte
    offsets) is read once; `read` maps one tensor's bytes (`np.memmap`), copies what it needs and
    unmaps them. (The safetensors library's `safe_open` keeps every page it read mapped until
    the file closes, so the resident size would grow by the whole file while loading.)

    Raises (on construction):
      CheckpointError: no config.json, no safetensors (or an index naming a missing shard), a
        file that is not safetensors, or a dtype headrace does not read.
    """

    def __init__(self, folder: str | pathlib.Path):
        self.folder = pathlib.Path(folder)
        try:
            self.config = json.loads((self.folder / "config.json").read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{self.folder}: no config.json (not a Hugging Face model "
                                  "folder)") from None
        except json.JSONDecodeError as error:
            raise CheckpointError(f"{self.folder}/config.json: not JSON ({error})") from None
        if (self.folder / INDEX).is_file():
            files = sorted(set(json.loads((self.folder / INDEX).read_text())["weight_map"]
                               .values()))
        elif (self.folder / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise CheckpointError(f"{self.folder}: neither {SINGLE} nor {INDEX} (headrace reads "
                                  "safetensors, not pytorch_model.bin)")
        self._entries: dict[str, tuple[pathlib.Path, str, tuple[int, ...], int]] = {}
        for name in files:
            path = self.folder / name
            if not path.is_file():
                raise CheckpointError(f"{self.folder}/{INDEX} names {name}, which is missing")
            self._entries.update(_header(path))
        self.tensors = _Tensors(self)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][2]

    def dtype(self, name: str) -> str:
        return self._entries[name][1]

    def read(self, name: str, index: tuple[slice, ...] | None = None, *,
             transpose: bool = False, dtype: Any = np.float32) -> np.ndarray:
        """The tensor `name` (or the block `index` selects), transposed if asked, as a new
        `dtype` array (bfloat16 and float16 are widened exactly).

        The file is memory-mapped and copied CHUNK_BYTES at a time, each chunk's pages released
        (`madvise(MADV_DONTNEED)`) once copied: the resident size grows by the result only.
        """
        path, stored, shape, offset = self._entries[name]
        source = np.dtype(_DTYPES[stored])
        count = int(np.prod(shape, dtype=np.int64))
        page = mmap.PAGESIZE
        lo = offset // page * page
        span = offset + count * source.itemsize - lo
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            raw = np.frombuffer(mm, source, count=count, offset=offset).reshape(shape)
            try:
                part = raw[index] if index is not None else raw
                out = aligned_empty(part.shape[::-1] if transpose else part.shape, dtype)
                if part.ndim == 0 or part.size == 0:
                    out[...] = _widen(part, stored)
                    return out
                row_bytes = max(1, part[0].size * source.itemsize)
                step = max(1, CHUNK_BYTES // row_bytes)
                for r in range(0, part.shape[0], step):
                    chunk = _widen(part[r:r + step], stored)
                    if transpose:
                        out[..., r:r + step] = chunk.T
                    else:
                        out[r:r + step] = chunk
                    if span > 0:
                        mm.madvise(mmap.MADV_DONTNEED, lo, span)
                return out
            finally:
                del raw  # no view may outlive the map
                part = chunk = None


def aligned_empty(shape: tuple[int, ...], dtype: Any, alignment: int = 64) -> np.ndarray:
    """`np.empty` whose data starts on an `alignment`-byte boundary: XLA's CPU client then uses
    the array as the device buffer instead of copying it (one copy of a tensor, not two)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _widen(block: np.ndarray, stored: str) -> np.ndarray:
    if stored == "BF16":
        return (block.astype(np.uint32) << 16).view(np.float32)
    return block


def _header(path: pathlib.Path) -> dict[str, tuple[pathlib.Path, str, tuple[int, ...], int]]:
    """name -> (file, dtype, shape, absolute byte offset) of one safetensors file."""
    try:
        with path.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: not a safetensors file ({error})") from None
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {info['dtype']}; headrace "
                                  f"reads {', '.join(_DTYPES)}")
        entries[name] = (path, info["dtype"], tuple(info["shape"]),
                         8 + length + int(info["data_offsets"][0]))
    return entries


class _Tensors(Mapping):
    def __init__(self, checkpoint: SafetensorsCheckpoint):
        self._checkpoint = checkpoint

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._checkpoint._entries:
            raise KeyError(name)
        return self._checkpoint.read(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._checkpoint.shape(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._checkpoint._entries)

    def __len__(self) -> int:
        return len(self._checkpoint._entries)


def save_tensors(path: str | pathlib.Path, tensors: Mapping[str, np.ndarray],
                 dtype: str = "float32") -> None:
    """Writes `tensors` cast to `dtype` (float32 or bfloat16) as one safetensors file at `path`
    (its folder made if missing), with the metadata transformers and peft expect.

    Raises:
      CheckpointError: an unknown dtype.
    """
    from safetensors.numpy import save_file

    if dtype not in ("float32", "bfloat16"):
        raise CheckpointError(f"--dtype {dtype}: float32 or bfloat16")
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if dtype == "bfloat16":
        import ml_dtypes

        target = np.dtype(ml_dtypes.bfloat16)
    else:
        target = np.dtype(np.float32)
    arrays = {k: np.ascontiguousarray(np.asarray(v).astype(target)) for k, v in tensors.items()}
    save_file(arrays, str(path), metadata={"format": "pt"})


def write(folder: str | pathlib.Path, config: dict, tensors: Mapping[str, np.ndarray],
          dtype: str = "float32") -> pathlib.Path:
    """Writes config.json and model.safetensors (tensors cast to `dtype`: float32 or bfloat16)
    into `folder` (made if missing). Returns the folder.

    Raises:
      CheckpointError: an unknown dtype.
    """
    folder = pathlib.Path(folder)
    save_tensors(folder / SINGLE, tensors, dtype)
    config = {**config, "dtype": dtype}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
