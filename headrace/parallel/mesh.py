"""The learner's named device mesh: axes `data`, `fsdp`, `tensor`, in that order.

- `data`: pure data parallelism. Parameters are replicated over it; the microbatch's rows are split
  over it and gradients are summed over it.
- `fsdp`: fully sharded data parallelism (ZeRO-3). Rows are split over it too, and every large
  parameter (and its optimizer state) is sharded over it; a layer's parameters are all-gathered
  just before use and their gradients reduce-scattered back.
- `tensor`: tensor (model) parallelism (Megatron): attention heads, the MLP hidden width and the
  vocabulary are split over it; activations are replicated over it.

The mesh is built from `config.parallel.mesh` (a size per axis, -1 for "the rest", missing axes
are 1) when `make_mesh` is called: importing this module touches no device. Axis types are
`Auto`, so plain arrays and `NamedSharding`s mix freely under `jax.jit` (jax 0.10 defaults to
`Explicit`; see PLATFORM.md). The axis names are `headrace.axes`'s (re-exported here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from headrace.axes import AXES as AXES
from headrace.axes import DATA as DATA
from headrace.axes import FSDP as FSDP
from headrace.axes import MODEL_AXES as MODEL_AXES
from headrace.axes import ROW_AXES as ROW_AXES
from headrace.axes import TENSOR as TENSOR
from headrace.config import ConfigError


def resolve_sizes(sizes: Mapping[str, int], devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes for `devices` devices; -1 takes what the other axes leave.

    Raises:
      ConfigError: an unknown axis, a size < 1 other than -1, more than one -1, or sizes whose
        product is not the device count (the message names the mesh and the device count).
    """
    unknown = set(sizes) - set(AXES)
    if unknown:
        raise ConfigError(f"parallel.mesh={dict(sizes)!r}: unknown axes {sorted(unknown)}; the "
                          f"axes are {', '.join(AXES)}")
    values = {axis: int(sizes.get(axis, 1)) for axis in AXES}
    rest = [axis for axis, size in values.items() if size == -1]
    if len(rest) > 1 or any(size < 1 and size != -1 for size in values.values()):
        raise ConfigError(f"parallel.mesh={dict(sizes)!r}: sizes must be >= 1, with at most one "
                          "-1 (the rest)")
    known = math.prod(size for size in values.values() if size != -1)
    if rest:
        if devices % known:
            raise ConfigError(f"parallel.mesh={dict(sizes)!r}: {devices} devices do not divide by "
                              f"the fixed axes' product {known}")
        values[rest[0]] = devices // known
    elif known != devices:
        raise ConfigError(f"parallel.mesh={dict(sizes)!r}: sizes multiply to {known} but there "
                          f"are {devices} devices; make the product {devices} or use -1 for one "
                          "axis (with simulated CPU devices, set XLA_FLAGS="
                          "--xla_force_host_platform_device_count=N before importing jax)")
    return values[DATA], values[FSDP], values[TENSOR]


def make_mesh(sizes: Mapping[str, int], devices: Sequence[Any] | None = None):
    """A `jax.sharding.Mesh` with axes (data, fsdp, tensor) and `Auto` axis types.

    Args:
      sizes: `config.parallel.mesh`, e.g. {"data": 2, "fsdp": -1, "tensor": 2}.
      devices: the devices to use, in order (default: all of `jax.devices()`). Neighbouring
        devices end up on the `tensor` axis, the innermost one (the most communication).

    Raises:
      ConfigError: see `resolve_sizes`.
    """
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_sizes(sizes, len(devices))
    grid = np.array(devices, dtype=object).reshape(shape)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def axis_size(mesh, axes: str | Sequence[str | None] | None) -> int:
    """How many shards `axes` (one name, several, or None) make on `mesh`."""
    if axes is None:
        return 1
    if isinstance(axes, str):
        return int(mesh.shape[axes])
    return math.prod(int(mesh.shape[a]) for a in axes if a is not None)


def row_shards(mesh) -> int:
    """How many ways a microbatch's rows are split (data x fsdp)."""
    return axis_size(mesh, ROW_AXES)
