"""Checkpoint formats (no JAX): Hugging Face folders (`hf`) and GGUF files (`gguf`).

A checkpoint is an HF-style config dict plus tensors named as Hugging Face names them (layout
[out, in], float32 or the file's dtype). `headrace.model.load` turns one into a model; `hf` also
writes one back. A checkpoint is named by a spec string, the value of `model.init_from`:

- `hf:DIR`: a folder with config.json and model.safetensors (or a sharded
  model.safetensors.index.json), as `save_pretrained` writes it;
- `gguf:FILE`: a GGUF file; `gguf:pkg:PACKAGE/PATH` is a file inside an installed Python
  package (found through importlib's module search, so examples need no machine path).
"""

from __future__ import annotations

import pathlib

from headrace.config import ConfigError

KINDS = ("hf", "gguf")


def checkpoint_kind(spec: str) -> str:
    """"hf" or "gguf" for a checkpoint spec, "" for anything else (a run folder, nothing)."""
    kind, sep, _ = (spec or "").partition(":")
    return kind if sep and kind in KINDS else ""


def resolve(spec: str, key: str = "model.init_from") -> tuple[str, pathlib.Path]:
    """(kind, path) of a checkpoint spec, the path checked to exist.

    Raises:
      ConfigError: not a checkpoint spec, a package that is not installed, or no such file/folder.
    """
    kind = checkpoint_kind(spec)
    if not kind:
        raise ConfigError(f"{key}={spec!r}: not a checkpoint; give hf:DIR, gguf:FILE or "
                          "gguf:pkg:PACKAGE/PATH")
    from headrace.formats.gguf import GGUFError, package_path

    rest = spec[len(kind) + 1:]
    try:
        path = package_path(rest).expanduser()  # pkg:PACKAGE/PATH, or a plain path
    except GGUFError as error:
        raise ConfigError(f"{key}={spec!r}: {error}") from None
    if kind == "hf" and not path.is_dir():
        raise ConfigError(f"{key}={spec!r}: no such folder; hf: names a folder holding "
                          "config.json and *.safetensors")
    if kind == "gguf" and not path.is_file():
        raise ConfigError(f"{key}={spec!r}: no such file")
    return kind, path
