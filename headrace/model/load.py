"""Real checkpoints in: `load("hf:DIR" | "gguf:FILE" | "gguf:pkg:PACKAGE/PATH")`.

    model = load("hf:/models/Qwen2.5-0.5B-Instruct")
    model.dims, model.params, model.tokenizer, model.chat_template, model.max_len

config.json (or the GGUF metadata, shaped like it) drives the architecture through
`headrace.formats.hf.spec_from_config`: no per-size tables. Parameters are read tensor by tensor
from the memory-mapped file and each is placed straight onto its target sharding
(`jax.make_array_from_callback`: every device's block is cut from that one tensor), so the
checkpoint never has to fit in host memory whole: at any moment the host holds the parameters
placed so far (on a CPU "device" they are host memory) plus one tensor being converted
(docs/models.md has the measured peak).

Failure modes: an unreadable or unsupported checkpoint, a missing tensor, a tensor the model does
not have, or a shape that differs from the config's are each one `CheckpointError` naming it.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from headrace.config import ConfigError
from headrace.formats import hf
from headrace.model import params as params_lib
from headrace.model.dims import ModelDims, dims_from_spec, open_checkpoint

log = logging.getLogger(__name__)
CheckpointError = hf.CheckpointError
# Tensors a checkpoint may hold that the model does not use (HF ignores them too).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass
class LoadedModel:
    """A checkpoint, loaded: dims, parameters (nested dict as `params.init` gives), the
    tokenizer and chat template (None where the checkpoint has none), the longest sequence it
    was made for, and its config.json (dict)."""

    dims: ModelDims
    params: dict[str, Any]
    tokenizer: Any
    chat_template: str | None
    max_len: int
    config: dict[str, Any]
    source: str


def _as_dtype(dtype: str) -> np.dtype:
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _reader(checkpoint, kind: str, name: str, transposed: bool, target: np.dtype
            ) -> Callable[[tuple], np.ndarray]:
    """index (of our layout) -> that block of the HF tensor `name` as a new `target` array in
    our layout. A safetensors tensor is read block by block from its map; a GGUF tensor is
    dequantized once (float32, HF layout) and its blocks cut from it."""
    if kind == "hf":
        return lambda index: checkpoint.read(name, index[::-1] if transposed else index,
                                             transpose=transposed, dtype=target)
    whole: list[np.ndarray] = []

    def read(index):
        if not whole:
            whole.append(checkpoint.tensors[name])
        part = whole[0][index[::-1] if transposed else index]
        return np.ascontiguousarray(part.T if transposed else part, dtype=target)

    return read


def _shape(checkpoint, kind: str, name: str) -> tuple[int, ...]:
    return tuple(checkpoint.shape(name) if kind == "hf" else checkpoint.tensors.shape(name))


def load(spec: str, *, dtype: str = "float32",
         shardings: Mapping[str, jax.sharding.Sharding] | None = None,
         with_text: bool = True) -> LoadedModel:
    """Loads the checkpoint `spec` names (see the module docstring).

    Args:
      spec: hf:DIR, gguf:FILE or gguf:pkg:PACKAGE/PATH.
      dtype: parameter dtype (float32 or bfloat16), whatever the file stores.
      shardings: {headrace param path: Sharding} to place each parameter on (default: the
        default device). `headrace.parallel.rules` gives them for a mesh.
      with_text: also build the tokenizer and read the chat template.

    Raises:
      CheckpointError (a ConfigError): see the module docstring.
    """
    kind, path, config, checkpoint = open_checkpoint(spec)
    where = f"{spec}: config"
    dims = dims_from_spec(hf.spec_from_config(config, where), dtype)
    table = hf.name_table(vars(dims))
    names = set(checkpoint.tensors)
    missing = [name for name, _, _ in table if name not in names]
    if missing:
        raise CheckpointError(f"{spec}: tensor(s) {', '.join(missing[:5])}"
                              f"{' ...' if len(missing) > 5 else ''} missing (the config says "
                              "the model has them)")
    used = {name for name, _, _ in table}
    extra = sorted(n for n in names - used if not n.endswith(_IGNORED_SUFFIXES)
                   and not (dims.tie_embeddings and n == "lm_head.weight"))
    if extra:
        raise CheckpointError(f"{spec}: tensor(s) {', '.join(extra[:5])} are not part of the "
                              "model its config describes (a field headrace does not read?)")
    expected = jax.eval_shape(lambda: params_lib.init(dims, 0)[1])
    expected_flat = params_lib.flatten(expected)
    target = _as_dtype(dtype)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    flat = {}
    for name, ours, transposed in table:
        shape = _shape(checkpoint, kind, name)
        want = tuple(expected_flat[ours].shape)
        mine = shape[::-1] if transposed else shape
        if mine != want:
            raise CheckpointError(f"{spec}: tensor {name} has shape {shape}, the config implies "
                                  f"{want[::-1] if transposed else want}")
        read = _reader(checkpoint, kind, name, transposed, target)

        def block(index, read=read, whole=tuple(slice(None) for _ in mine)):
            return read(tuple(index) if index is not None else whole)

        sharding = (shardings or {}).get(ours, device)
        flat[ours] = jax.make_array_from_callback(mine, sharding, block)
    tokenizer = template = None
    if with_text:
        tokenizer, template = _text(kind, path, checkpoint)
    log.info("loaded %s: %d layers, d %d, vocab %d", spec, dims.n_layers, dims.d_model,
             dims.vocab_size)
    return LoadedModel(dims, params_lib.unflatten(flat), tokenizer, template,
                       hf.max_len(config), config, spec)


def _text(kind: str, path: pathlib.Path, checkpoint):
    """(tokenizer, chat template) of a checkpoint; (None, None) for a folder without
    tokenizer.json."""
    from headrace.text import hf_tokenizer

    try:
        if kind == "gguf":
            return hf_tokenizer.gguf_tokenizer(checkpoint), checkpoint.chat_template
        if not (path / "tokenizer.json").is_file():
            return None, None
        tokenizer = hf_tokenizer.folder_tokenizer(path)
        return tokenizer, getattr(tokenizer, "chat_template", None)
    except (ValueError, OSError) as error:
        raise ConfigError(f"{path}: its tokenizer does not load ({error})") from None
