"""msgpack encoding of groups with raw NumPy buffers and a schema version (never pickle).

Layout: a map `{"v": SCHEMA_VERSION, "group": {...}, "trajectories": [...]}` where every array is
`[dtype, shape, raw bytes]` in little-endian order. `decode` validates everything it reads and raises
`MalformedEntry` (one error type) for any byte string that is not a well-formed group.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgpack
import numpy as np

from headrace.types import SCHEMA_VERSION, Group, Trajectory, Turn

_ARRAYS = {"tokens": "<i4", "loss_mask": "|b1", "behaviour_logprobs": "<f4", "policy_version": "<i4"}


class MalformedEntry(ValueError):
    """Bytes that do not decode to a valid group of this schema version."""


def _encode_array(array: np.ndarray, dtype: str) -> list:
    array = np.ascontiguousarray(array, dtype=dtype)
    return [dtype, list(array.shape), array.tobytes()]


def _decode_array(raw: Any, dtype: str) -> np.ndarray:
    if not (isinstance(raw, list) and len(raw) == 3 and raw[0] == dtype
            and isinstance(raw[2], bytes)):
        raise MalformedEntry(f"expected a {dtype} array record")
    shape = tuple(raw[1])
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise MalformedEntry(f"bad array shape {shape!r}")
    array = np.frombuffer(raw[2], dtype=dtype)
    if array.size != math.prod(shape):
        raise MalformedEntry(f"array of {array.size} items does not fill shape {shape}")
    return array.reshape(shape).astype(np.dtype(dtype).newbyteorder("="), copy=False)


def _encode_trajectory(t: Trajectory) -> dict:
    record = {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name not in _ARRAYS}
    record["turns"] = [[u.start, u.end, u.role, u.reward] for u in t.turns]
    for name, dtype in _ARRAYS.items():
        record[name] = _encode_array(getattr(t, name), dtype)
    return record


def _decode_trajectory(record: Any) -> Trajectory:
    if not isinstance(record, dict):
        raise MalformedEntry("trajectory record is not a map")
    try:
        fields = dict(record)
        for name, dtype in _ARRAYS.items():
            fields[name] = _decode_array(fields[name], dtype)
        fields["turns"] = [Turn(*turn) for turn in fields["turns"]]  # types checked by validate
        trajectory = Trajectory(**fields)
    except MalformedEntry:
        raise
    except (KeyError, TypeError, ValueError) as error:
        raise MalformedEntry(f"bad trajectory record: {error}") from None
    return trajectory


def encode(group: Group) -> bytes:
    return msgpack.packb({
        "v": SCHEMA_VERSION,
        "group": {"group_id": group.group_id, "task_id": group.task_id,
                  "put_version": group.put_version},
        "trajectories": [_encode_trajectory(t) for t in group.trajectories],
    }, use_bin_type=True)


def decode(data: bytes) -> Group:
    """Decodes and validates one group.

    Raises:
      MalformedEntry: not msgpack, another schema version, a missing or mistyped field, or arrays
        whose shapes disagree.
    """
    try:
        record = msgpack.unpackb(data, raw=False)
    except Exception as error:  # msgpack raises several unrelated types for garbage
        raise MalformedEntry(f"not a msgpack record: {type(error).__name__}") from None
    if not isinstance(record, dict) or record.get("v") != SCHEMA_VERSION:
        version = record.get("v") if isinstance(record, dict) else None
        raise MalformedEntry(f"schema version {version!r}, expected {SCHEMA_VERSION}")
    try:
        header = record["group"]
        group = Group(group_id=str(header["group_id"]), task_id=str(header["task_id"]),
                      trajectories=[_decode_trajectory(t) for t in record["trajectories"]],
                      put_version=int(header["put_version"]))
        group.validate()
    except MalformedEntry:
        raise
    except (KeyError, TypeError, ValueError) as error:
        raise MalformedEntry(f"bad group record: {error}") from None
    return group
