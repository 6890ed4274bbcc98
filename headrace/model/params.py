"""Parameters as plain nested dicts (jit, optax and Orbax friendly) and their flat wire form.

`init(dims, seed)` returns the NNX graph definition and a nested dict of arrays; `merge` rebuilds
the module inside a jitted function. `flatten`/`unflatten` convert to and from the weight store's
flat `{"layers.0.attn.q.kernel": ndarray}` mapping.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from flax import nnx

from headrace.model.transformer import ModelDims, Transformer, build_model

Params = dict[str, Any]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_params(dims: ModelDims, seed: int) -> Params:
    return nnx.to_pure_dict(nnx.split(build_model(dims, seed))[1])


def graphdef(dims: ModelDims) -> nnx.GraphDef:
    """The model's structure without materialising any parameter (actors get weights later)."""
    return nnx.graphdef(nnx.eval_shape(lambda: build_model(dims, 0)))


def init(dims: ModelDims, seed: int) -> tuple[nnx.GraphDef, Params]:
    """Graph definition and freshly initialised params (one compiled program, not one per array)."""
    return graphdef(dims), _init_params(dims, seed)


def merge(graphdef: nnx.GraphDef, params: Params) -> Transformer:
    return nnx.merge(graphdef, params)


def flatten(params: Params, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in params.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def unflatten(flat: dict[str, Any]) -> Params:
    tree: Params = {}
    for path, value in flat.items():
        node = tree
        keys = [int(k) if k.isdigit() else k for k in path.split(".")]
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return tree


def to_host(params: Params) -> dict[str, np.ndarray]:
    """Flat NumPy copy of device params. A deliberate device->host sync (weight publishing)."""
    return {k: np.asarray(v) for k, v in flatten(jax.device_get(params)).items()}


def from_host(flat: dict[str, np.ndarray]) -> Params:
    """Device params from the flat NumPy form (host->device copy)."""
    return jax.device_put(unflatten(flat))


def count(params: Params) -> int:
    return sum(int(np.prod(v.shape)) for v in flatten(params).values())
