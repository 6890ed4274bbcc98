"""msgpack encoding of groups with raw NumPy buffers and a schema version (never pickle).

Layout: a map `{"v": SCHEMA_VERSION, "group": {...}, "trajectories": [...]}` where every array is
`[dtype, shape, raw bytes]` in little-endian order. `decode` validates everything it reads, the
values as well as the structure, and raises `MalformedEntry` (one error type, whatever the bytes)
for any byte string that is not a well-formed group a learner can train on:

  reason          what                                                 examples
  `undecodable`   not msgpack, not a map, cut short                    garbage, a truncated payload
  `schema`        another schema version, a missing or an unknown key  `{"v": 2}`, no `reward`
  `type`          a field of the wrong type                            `reward: "abc"`, `put_version: 1.5`
  `shape`         arrays that disagree with each other or their shape  5 tokens, 4 log-probs
  `non_finite`    NaN or infinity in a number                          `put_version: inf`, NaN log-prob
  `range`         a value outside its domain                           version < -1, a turn past the end
  `token_id`      a token id < 0, or >= the model's vocabulary         (the vocabulary: `check_tokens`)

Each reason is counted as `buffer/quarantined_<reason>` by the buffers (`QUARANTINE_REASONS`).
The vocabulary is the model's, which the buffer does not know: the learner checks it with
`check_tokens` before training and quarantines through the buffer.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import msgpack
import numpy as np

from headrace.types import ROLES, SCHEMA_VERSION, STATUSES, Group, Trajectory, Turn

_ARRAYS = {"tokens": "<i4", "loss_mask": "|b1", "behaviour_logprobs": "<f4", "policy_version": "<i4"}
_NATIVE = {dtype: np.dtype(dtype).newbyteorder("=") for dtype in _ARRAYS.values()}
_TRAJECTORY_KEYS = frozenset(f.name for f in dataclasses.fields(Trajectory))
_SCALARS = tuple(f.name for f in dataclasses.fields(Trajectory) if f.name not in _ARRAYS)
_STRINGS = ("trajectory_id", "group_id", "task_id", "env", "actor_id", "status")
_ROLES = frozenset(ROLES)
_GROUP_KEYS = frozenset({"group_id", "task_id", "put_version"})
_INT32 = (-(2**31), 2**31 - 1)

UNDECODABLE, SCHEMA, TYPE, SHAPE, NON_FINITE, RANGE, TOKEN_ID = (
    "undecodable", "schema", "type", "shape", "non_finite", "range", "token_id")
QUARANTINE_REASONS = (UNDECODABLE, SCHEMA, TYPE, SHAPE, NON_FINITE, RANGE, TOKEN_ID)


class MalformedEntry(ValueError):
    """Bytes that do not decode to a valid group of this schema version.

    Attributes:
      reason: one of `QUARANTINE_REASONS` (what kind of defect; the message says where).
    """

    def __init__(self, message: str, reason: str = SCHEMA):
        super().__init__(message)
        self.reason = reason


def _encode_array(array: np.ndarray, dtype: str) -> list:
    array = np.ascontiguousarray(array, dtype=dtype)
    return [dtype, list(array.shape), array.tobytes()]


def _decode_array(raw: Any, dtype: str, where: str, name: str) -> np.ndarray:
    if not (type(raw) is list and len(raw) == 3 and type(raw[1]) is list
            and type(raw[2]) is bytes):
        raise MalformedEntry(f"{where}.{name}: expected a [dtype, shape, bytes] array record", TYPE)
    if raw[0] != dtype:
        raise MalformedEntry(f"{where}.{name}: dtype {raw[0]!r}, expected {dtype!r}", TYPE)
    shape = raw[1]
    if not (len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0):
        raise MalformedEntry(f"{where}.{name}: bad array shape {shape!r} (one length)", SHAPE)
    if len(raw[2]) != shape[0] * np.dtype(dtype).itemsize:
        raise MalformedEntry(f"{where}.{name}: {len(raw[2])} bytes do not fill shape {shape}",
                             SHAPE)
    return np.frombuffer(raw[2], dtype=dtype).astype(_NATIVE[dtype], copy=False)


def _encode_trajectory(t: Trajectory) -> dict:
    record = {name: getattr(t, name) for name in _SCALARS}
    record["turns"] = [[u.start, u.end, u.role, u.reward] for u in t.turns]
    for name, dtype in _ARRAYS.items():
        record[name] = _encode_array(getattr(t, name), dtype)
    return record


def _finite_float(value: Any) -> bool:
    """Whether `value` is a finite Python float: the common case, checked without a call that
    builds a message (inf - inf and NaN - NaN are NaN, which equals nothing)."""
    return type(value) is float and value - value == 0.0


def _real(value: Any, where: str) -> float:
    """A finite real number (int or float; not bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise MalformedEntry(f"{where}: {type(value).__name__} {value!r:.40}, expected a number",
                             TYPE)
    if not math.isfinite(value):
        raise MalformedEntry(f"{where}: {value!r} is not finite", NON_FINITE)
    return float(value)


def _int(value: Any, where: str, low: int, high: int = _INT32[1]) -> int:
    if isinstance(value, float) and not math.isfinite(value):
        raise MalformedEntry(f"{where}: {value!r} is not finite", NON_FINITE)
    if type(value) is not int:
        raise MalformedEntry(f"{where}: {type(value).__name__} {value!r:.40}, expected an int",
                             TYPE)
    if not low <= value <= high:
        raise MalformedEntry(f"{where}: {value} outside [{low}, {high}]", RANGE)
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise MalformedEntry(f"{where}: {type(value).__name__}, expected a string", TYPE)
    return value


def _keys(record: Any, expected: frozenset, where: str) -> dict:
    if not isinstance(record, dict):
        raise MalformedEntry(f"{where} is not a map", TYPE)
    if record.keys() != expected:
        missing, extra = sorted(expected - record.keys()), sorted(map(str, record.keys() - expected))
        raise MalformedEntry(f"{where}: missing keys {missing}, unknown keys {extra}", SCHEMA)
    return record


def _decode_turns(raw: Any, n: int, where: str) -> list[Turn]:
    if type(raw) is not list:
        raise MalformedEntry(f"{where}.turns: expected a list", TYPE)
    turns = []
    for k, t in enumerate(raw):
        # The usual turn passes this test at once; any other goes through _decode_turn, which
        # accepts everything this accepts and names what is wrong with the rest.
        if (type(t) is list and len(t) == 4 and type(t[0]) is int and type(t[1]) is int
                and 0 <= t[0] <= t[1] <= n and type(t[2]) is str and t[2] in _ROLES
                and _finite_float(t[3])):
            turns.append(Turn(t[0], t[1], t[2], t[3]))
        else:
            turns.append(_decode_turn(t, n, f"{where}.turns[{k}]"))
    return turns


def _decode_turn(raw: Any, n: int, where: str) -> Turn:
    if not (isinstance(raw, list) and len(raw) == 4):
        raise MalformedEntry(f"{where}: expected [start, end, role, reward]", TYPE)
    start, end = _int(raw[0], f"{where}.start", 0, n), _int(raw[1], f"{where}.end", 0, n)
    role = _str(raw[2], f"{where}.role")
    if start > end or role not in ROLES:
        raise MalformedEntry(f"{where}: [{start}, {end}) role {role!r:.20} does not fit {n} tokens "
                             f"and roles {ROLES}", RANGE)
    return Turn(start, end, role, _real(raw[3], f"{where}.reward"))


def _decode_trajectory(record: Any, index: int) -> Trajectory:
    where = f"trajectory {index}"
    fields = dict(_keys(record, _TRAJECTORY_KEYS, where))
    for name, dtype in _ARRAYS.items():
        fields[name] = _decode_array(fields[name], dtype, where, name)
    n = len(fields["tokens"])
    for name in _ARRAYS:
        if len(fields[name]) != n:
            raise MalformedEntry(f"{where}.{name}: {len(fields[name])} items, tokens has {n}",
                                 SHAPE)
    if not all(type(fields[name]) is str for name in _STRINGS):
        for name in _STRINGS:
            _str(fields[name], f"{where}.{name}")
    if fields["status"] not in STATUSES:
        raise MalformedEntry(f"{where}.status {fields['status']!r:.20}: one of {STATUSES}", RANGE)
    if fields["error"] is not None:
        _str(fields["error"], f"{where}.error")
    fields["turns"] = _decode_turns(fields["turns"], n, where)
    if not _finite_float(fields["reward"]):
        fields["reward"] = _real(fields["reward"], f"{where}.reward")
    timings = fields["timings"]
    if type(timings) is not dict:
        raise MalformedEntry(f"{where}.timings: expected a map of stage -> unix time", TYPE)
    if not all(type(k) is str and _finite_float(v) for k, v in timings.items()):
        fields["timings"] = {_str(k, f"{where}.timings key"): _real(v, f"{where}.timings[{k}]")
                             for k, v in timings.items()}
    if type(fields["sampling"]) is not dict:
        raise MalformedEntry(f"{where}.sampling: expected a map", TYPE)
    if fields["schema_version"] != SCHEMA_VERSION or type(fields["schema_version"]) is not int:
        _int(fields["schema_version"], f"{where}.schema_version", SCHEMA_VERSION, SCHEMA_VERSION)
    return Trajectory(**fields)


def _check_arrays(trajectories: list[Trajectory]) -> None:
    """Values of the per-token arrays, a group's at once (no per-token or per-trajectory numpy
    call: on a few dozen tokens each call costs more than its work); a defect is then looked for
    trajectory by trajectory, to name it."""
    tokens, logprobs, versions = (np.concatenate([getattr(t, name) for t in trajectories])
                                  for name in ("tokens", "behaviour_logprobs", "policy_version"))
    if tokens.size and (tokens.min() < 0 or versions.min() < -1 or not np.isfinite(logprobs).all()):
        for index, trajectory in enumerate(trajectories):
            _check_trajectory_arrays(trajectory, f"trajectory {index}")


def _check_trajectory_arrays(trajectory: Trajectory, where: str) -> None:
    tokens, logprobs, versions = (trajectory.tokens, trajectory.behaviour_logprobs,
                                  trajectory.policy_version)
    if tokens.size and tokens.min() < 0:
        raise MalformedEntry(f"{where}.tokens: id {int(tokens.min())} < 0", TOKEN_ID)
    finite = np.isfinite(logprobs)
    if not finite.all():
        at = int(np.argmin(finite))
        raise MalformedEntry(f"{where}.behaviour_logprobs[{at}] = {logprobs[at]}", NON_FINITE)
    if versions.size and versions.min() < -1:
        raise MalformedEntry(f"{where}.policy_version: {int(versions.min())} < -1", RANGE)


def encode(group: Group) -> bytes:
    return msgpack.packb({
        "v": SCHEMA_VERSION,
        "group": {"group_id": group.group_id, "task_id": group.task_id,
                  "put_version": group.put_version},
        "trajectories": [_encode_trajectory(t) for t in group.trajectories],
    }, use_bin_type=True)


def decode(data: bytes) -> Group:
    """Decodes and validates one group (structure and values; not the vocabulary).

    Raises:
      MalformedEntry: for any defect (see the module docstring for the reasons), never another
        exception type.
    """
    try:
        return _decode(data)
    except MalformedEntry:
        raise
    except Exception as error:  # a defect no check above names: still one error type
        raise MalformedEntry(f"bad record: {type(error).__name__}: {error}"[:300],
                             UNDECODABLE) from None


def _decode(data: bytes) -> Group:
    try:
        record = msgpack.unpackb(data, raw=False)
    except Exception as error:  # msgpack raises several unrelated types for garbage
        raise MalformedEntry(f"not a msgpack record: {type(error).__name__}",
                             UNDECODABLE) from None
    if not isinstance(record, dict) or record.get("v") != SCHEMA_VERSION:
        version = record.get("v") if isinstance(record, dict) else None
        raise MalformedEntry(f"schema version {version!r:.40}, expected {SCHEMA_VERSION}", SCHEMA)
    _keys(record, frozenset({"v", "group", "trajectories"}), "record")
    header = _keys(record["group"], _GROUP_KEYS, "group header")
    group_id = _str(header["group_id"], "group.group_id")
    task_id = _str(header["task_id"], "group.task_id")
    put_version = _int(header["put_version"], "group.put_version", -1)
    trajectories = record["trajectories"]
    if not isinstance(trajectories, list) or not trajectories:
        raise MalformedEntry("trajectories: expected a non-empty list", SHAPE)
    decoded = [_decode_trajectory(t, i) for i, t in enumerate(trajectories)]
    _check_arrays(decoded)
    for index, trajectory in enumerate(decoded):  # the rest of Group.validate is checked above
        if trajectory.group_id != group_id:
            raise MalformedEntry(f"bad group: trajectory {index} names group "
                                 f"{trajectory.group_id!r:.40}, not {group_id!r:.40}", RANGE)
    return Group(group_id=group_id, task_id=task_id, trajectories=decoded,
                 put_version=put_version)


def check_tokens(group: Group, vocab_size: int) -> None:
    """Raises MalformedEntry (`token_id`) when a token id is >= `vocab_size` (ids < 0 are refused
    by `decode`): an embedding lookup past the table would train on garbage (on CPU it reads
    NaN-filled or clamped rows), so the learner checks before training."""
    tokens = np.concatenate([t.tokens for t in group.trajectories])  # one call, not one each
    if not tokens.size or int(tokens.max()) < vocab_size:
        return
    for i, t in enumerate(group.trajectories):
        if t.tokens.size and int(t.tokens.max()) >= vocab_size:
            raise MalformedEntry(f"trajectory {i}.tokens: id {int(t.tokens.max())} >= the "
                                 f"model's vocabulary {vocab_size}", TOKEN_ID)


def group_id_of(data: bytes) -> str | None:
    """The group id a payload of this schema version names, if it can be read at all (for the
    accounting of a quarantined entry: a group written with a bad value is still that group);
    else None (garbage, or another schema's record: it names no group of this run's)."""
    try:
        record = msgpack.unpackb(data, raw=False)
        group_id = record["group"]["group_id"] if record["v"] == SCHEMA_VERSION else None
    except Exception:  # anything undecodable names no group
        return None
    return group_id if isinstance(group_id, str) else None
