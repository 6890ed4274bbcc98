"""vLLM worker extension: loads headrace weight versions into a running vLLM server (no JAX).

Runs inside vLLM's worker process (`--worker-extension-cls
headrace.engines.vllm_worker.HeadraceWorker`), in vLLM's own environment: it imports only the
JAX-free parts of headrace (the directory weight store and the Hugging Face name table) plus
numpy and torch, which vLLM brings. The engine client (`headrace.engines.vllm_engine`) calls it
through the server's `/collective_rpc` (which passes string arguments only) while generation is
paused (`/pause?mode=keep`): requests in flight stay in the scheduler, their caches kept.

Failure modes: a version the store no longer holds raises `VersionGone`, a damaged one
`CorruptWeights`; the RPC then answers 500 with the message, and nothing is loaded (the names
are all checked before the first tensor is copied).
"""

from __future__ import annotations

import json
import time

import numpy as np

from headrace.formats import hf, peft
from headrace.weights.directory import DirWeightStore


def hf_tensors(flat: dict[str, np.ndarray], spec: dict) -> list[tuple[str, np.ndarray]]:
    """The store's flat arrays (headrace names) as (Hugging Face name, float32 array) pairs,
    laid out as `headrace.runtime.export` writes them (the same `hf.name_table`).

    Raises:
      KeyError: the version lacks a parameter the model needs (a different model's weights).
    """
    out = []
    for name, ours, transposed in hf.name_table(spec):
        if ours not in flat:
            raise KeyError(f"weights hold no {ours!r} (for {name}): not this model's weights")
        array = np.asarray(flat[ours], np.float32)
        out.append((name, array.T if transposed else array))
    return out


def export_version(store: DirWeightStore, version: int, spec: dict, out, *,
                   family: str = "llama", dtype: str = "float32", max_len: int = 0,
                   extra_config: dict | None = None):
    """Writes `version` of `store` as the Hugging Face folder `out` a server starts from: what
    `headrace.runtime.export.export_params` writes (the same `hf.config_from_spec`,
    `hf.name_table` and `hf.write`), read straight from the store's flat arrays, without JAX.

    Raises:
      VersionGone, CorruptWeights: the store cannot give `version`.
      CheckpointError: the model cannot be expressed as `family`.
    """
    return export_flat(store.load(version), spec, out, family=family, dtype=dtype,
                       max_len=max_len, extra_config=extra_config)


def export_flat(flat: dict[str, np.ndarray], spec: dict, out, *, family: str = "llama",
                dtype: str = "float32", max_len: int = 0, extra_config: dict | None = None):
    """Writes the flat weights `flat` (headrace names) as a Hugging Face folder `out`, as
    `export_version` writes a stored version.

    Raises:
      KeyError: `flat` lacks a parameter of the model `spec`.
      CheckpointError: the model cannot be expressed as `family`.
    """
    config = hf.config_from_spec(spec, family, max_len, extra_config)
    return hf.write(out, config, dict(hf_tensors(flat, spec)), dtype)


def export_adapter_version(store: DirWeightStore, version: int, spec: dict, out, *,
                           expected: dict[str, tuple[int, ...]], rank: int, alpha: float,
                           targets, base: str, dtype: str = "float32"):
    """Writes `version` of a LoRA run's store (adapters only) as the PEFT folder `out` that a
    server started on the base folder `base` loads (`/v1/load_lora_adapter`), after checking
    its keys and shapes against `expected` (`headrace.model.lora.shapes` of the base).

    Raises:
      VersionGone, CorruptWeights: the store cannot give `version`.
      AdapterError: the version holds full weights, or adapters of another rank or targets.
    """
    flat = store.load(version)
    peft.check(flat, expected, f"weights version {version}")
    return peft.write_adapter(out, spec, flat, rank=rank, alpha=alpha, targets=targets,
                              base=base, dtype=dtype)


class HeadraceWorker:
    """Mixed into vLLM's worker class; its methods are called by name via collective_rpc."""

    def headrace_load(self, root: str, version: str, spec: str) -> dict:
        """Loads weights `version` of the directory store at `root` into the model.

        Args (strings: the RPC's only kind): `root` the store's directory, `version` an int,
        `spec` the model's `ModelDims` fields as JSON (they pick the name table).

        Returns:
          {"version", "load_s", "bytes", "generated": {request id: output tokens so far}}:
          the requests the runner holds and how many tokens each has generated, all with the
          weights before this load (the scheduler is paused: none advances meanwhile).
        """
        import torch

        start = time.perf_counter()
        store = DirWeightStore(root, keep=1)  # read-only use: keep only matters to publish
        flat = store.load(int(version))
        pairs = hf_tensors(flat, json.loads(spec))
        # reload_weights, not model.load_weights: on CPU, loading repacks some weights into
        # kernel layouts (dropping their loaders); vLLM's in-place reload restores the
        # checkpoint layout, loads, and repacks again
        self.model_runner.reload_weights(
            weights_iterator=[(name, torch.from_numpy(np.ascontiguousarray(a)))
                              for name, a in pairs], is_checkpoint_format=True)
        generated = {req_id: len(state.output_token_ids)
                     for req_id, state in self.model_runner.requests.items()}
        self.headrace_version = int(version)
        return {"version": int(version), "load_s": time.perf_counter() - start,
                "bytes": int(store.last_load_bytes), "generated": generated}

    def headrace_version_loaded(self) -> int:
        """The version the last `headrace_load` installed (-1: the weights it started with)."""
        return getattr(self, "headrace_version", -1)
