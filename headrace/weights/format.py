"""What every durable weight store shares: supported dtypes, the checks on what is published, and
the checks on a manifest's array records before a byte is read. JAX-free (NumPy and ml_dtypes
only), so a reader without JAX (an inference server's worker) can use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import ml_dtypes
import numpy as np

FORMAT = 1  # the manifest format both durable stores write

# Every dtype a parameter may have, by the name the manifest records.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                 "uint64", "float16", "float32", "float64")
}
DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)


class CorruptWeights(ValueError):
    """A published version's bytes do not match its manifest (bit rot, truncation, tampering)."""


def check_version(version: object) -> int:
    """`version` as an int.

    Raises:
      ValueError: not an int (bools refused).
    """
    if not isinstance(version, (int, np.integer)) or isinstance(version, bool):
        raise ValueError(f"version must be an int, got {version!r}")
    return int(version)


def check_params(params: object) -> None:
    """Refuses what no store can publish, before anything is written or copied: not a non-empty
    mapping, a key that is not a non-empty string, an unsupported dtype.

    Raises:
      ValueError: what is wrong and how to fix it.
    """
    if not isinstance(params, Mapping) or not params:
        raise ValueError("params must be a non-empty mapping of dotted path -> array")
    for path, value in params.items():
        if not isinstance(path, str) or not path:
            raise ValueError(f"parameter name {path!r} must be a non-empty string")
        dtype = getattr(value, "dtype", None)  # a jax.Array's dtype without copying it
        name = np.dtype(dtype).name if dtype is not None else np.asarray(value).dtype.name
        if name not in DTYPES:
            raise ValueError(f"parameter {path!r} has dtype {name}; supported dtypes are "
                             f"{', '.join(sorted(DTYPES))}: cast it before publishing")


def as_host_array(path: str, value) -> np.ndarray:
    """`value` as a C-contiguous, native-order NumPy array of a supported dtype."""
    array = np.asarray(value)  # a jax.Array is copied to the host here (a device sync)
    if array.dtype.name not in DTYPES:
        raise ValueError(f"parameter {path!r} has dtype {array.dtype}; supported dtypes are "
                         f"{', '.join(sorted(DTYPES))}: cast it before publishing")
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return np.ascontiguousarray(array).reshape(array.shape)


def host_arrays(params: Mapping) -> Iterator[tuple[str, np.ndarray]]:
    """(path, host array) one parameter at a time: at most one extra copy alive at once."""
    for path, value in params.items():
        yield path, as_host_array(path, value)


def is_plain_name(name: object) -> bool:
    """Whether `name` is a single, plain path component (what a manifest may name): a non-empty
    string without a separator, NUL byte or `:`, and not `.` or `..`."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name and ":" not in name
            and not name.startswith("/"))


def parse_record(record: object, where: str) -> tuple[str, np.dtype, tuple[int, ...], int, int]:
    """(parameter path, dtype, shape, byte count, crc32) of one manifest array record, with
    the byte count checked against dtype and shape.

    Raises:
      CorruptWeights: a missing or malformed field, an unknown dtype, a negative dimension or a
        byte count that does not match; the message names `where` (the manifest) and the record.
    """
    try:
        name = record["path"]
        dtype = DTYPES[record["dtype"]]
        shape = tuple(int(n) for n in record["shape"])
        nbytes, crc = int(record["nbytes"]), int(record["crc32"])
        ok = isinstance(name, str) and bool(name) and all(n >= 0 for n in shape)
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise CorruptWeights(f"{where} has a malformed array record {str(record)[:120]}; "
                             "republish the version")
    if math.prod(shape) * dtype.itemsize != nbytes:
        raise CorruptWeights(f"{where}: parameter {name!r} claims {nbytes} bytes for "
                             f"{record['dtype']}{list(shape)}")
    return name, dtype, shape, nbytes, crc
