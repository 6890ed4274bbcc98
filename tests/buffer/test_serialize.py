"""Serialization of groups: exact round trips, and `MalformedEntry` (only) for every bad input."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from headrace.buffer.serialize import QUARANTINE_REASONS, MalformedEntry, check_tokens, decode, encode
from headrace.types import SCHEMA_VERSION, Group, Trajectory, Turn


def full_group() -> Group:
    """A group that sets every field of Group, Trajectory and Turn to a non-default value."""
    ok = Trajectory(
        trajectory_id="traj-0", group_id="grp-7", task_id="task-3", env="guess_number",
        actor_id="actor-2", tokens=np.array([5, 9, 2, 7, 1], np.int32),
        loss_mask=np.array([0, 0, 1, 1, 0], bool),
        behaviour_logprobs=np.array([0, 0, -0.25, -1.5, 0], np.float32),
        policy_version=np.array([-1, -1, 4, 5, -1], np.int32),
        turns=[Turn(0, 2, "system"), Turn(2, 4, "assistant", 0.5), Turn(4, 5, "tool", -1.0)],
        reward=-0.5, status="truncated", error=None,
        timings={"admitted": 100.0, "started": 100.5, "finished": 103.25},
        sampling={"temperature": 0.7, "top_k": 20, "top_p": 0.9})
    failed = Trajectory(
        trajectory_id="traj-1", group_id="grp-7", task_id="task-3", env="guess_number",
        actor_id="actor-2", tokens=np.zeros(0, np.int32), loss_mask=np.zeros(0, bool),
        behaviour_logprobs=np.zeros(0, np.float32), policy_version=np.zeros(0, np.int32),
        turns=[], reward=0.0, status="error", error="env step timed out after 30 s",
        timings={"started": 101.0}, sampling={})
    return Group("grp-7", "task-3", [ok, failed], put_version=12)


def assert_same(a: Group, b: Group) -> None:
    assert (a.group_id, a.task_id, a.put_version) == (b.group_id, b.task_id, b.put_version)
    assert len(a.trajectories) == len(b.trajectories)
    for x, y in zip(a.trajectories, b.trajectories, strict=True):
        for field in dataclasses.fields(Trajectory):
            u, v = getattr(x, field.name), getattr(y, field.name)
            if isinstance(u, np.ndarray):
                assert u.dtype == v.dtype and u.shape == v.shape, field.name
                np.testing.assert_array_equal(u, v, err_msg=field.name)
            else:
                assert u == v, field.name


def record(group: Group) -> dict:
    return msgpack.unpackb(encode(group), raw=False)


def pack(rec: dict) -> bytes:
    return msgpack.packb(rec, use_bin_type=True)


def test_round_trip_keeps_every_field():
    group = full_group()
    back = decode(encode(group))
    assert_same(group, back)
    assert back.trajectories[0].schema_version == SCHEMA_VERSION
    assert back.oldest_version == 4 and back.started == 100.5


def test_whole_numbers_where_floats_belong_decode_as_floats():
    """A writer may send 2 for 2.0 (msgpack keeps ints): the checked path takes what the quick
    one does not, so rewards and times come back as the same floats either way."""
    rec = record(full_group())
    ok = rec["trajectories"][0]
    ok["turns"][1][3], ok["reward"], ok["timings"]["started"] = 1, -2, 100
    back = decode(pack(rec)).trajectories[0]
    assert back.turns[1] == Turn(2, 4, "assistant", 1.0) and type(back.turns[1].reward) is float
    assert back.reward == -2.0 and type(back.reward) is float
    assert back.timings["started"] == 100.0 and type(back.timings["started"]) is float


def test_round_trip_of_big_arrays_is_exact():
    rng = np.random.default_rng(0)
    n = 5000
    t = Trajectory("t", "g", "k", "e", "a", rng.integers(0, 2**31 - 1, n, dtype=np.int32),
                   rng.random(n) < 0.5, rng.standard_normal(n).astype(np.float32),
                   rng.integers(-1, 100, n, dtype=np.int32), [Turn(0, n, "assistant", 1.0)], 1.0)
    assert_same(Group("g", "k", [t]), decode(encode(Group("g", "k", [t]))))


@pytest.mark.parametrize("data", [
    b"", b"\x00", b"\xc1", b"garbage bytes", b"\x93\x01\x02",
    msgpack.packb([1, 2, 3]), msgpack.packb("a string"), msgpack.packb({"x": 1}),
])
def test_garbage_is_malformed(data):
    with pytest.raises(MalformedEntry):
        decode(data)


def test_every_truncation_is_malformed():
    data = encode(full_group())
    for cut in range(0, len(data), max(1, len(data) // 97)):
        with pytest.raises(MalformedEntry):
            decode(data[:cut])


@pytest.mark.parametrize("version", [SCHEMA_VERSION + 1, 0, "1", None])
def test_other_schema_versions_are_malformed(version):
    rec = record(full_group())
    rec["v"] = version
    with pytest.raises(MalformedEntry, match="schema version"):
        decode(pack(rec))


def test_missing_schema_version_is_malformed():
    rec = record(full_group())
    del rec["v"]
    with pytest.raises(MalformedEntry):
        decode(pack(rec))


def _mutate(path: tuple, value) -> bytes:
    rec = record(full_group())
    node = rec
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return pack(rec)


@pytest.mark.parametrize("path,value", [
    (("trajectories", 0, "tokens", 1), [6]),  # shape disagrees with the bytes
    (("trajectories", 0, "loss_mask"), ["|b1", [4], b"\x00\x01\x01\x00"]),  # T-1 items
    (("trajectories", 0, "policy_version"), ["<i4", [2, 2], np.zeros(4, "<i4").tobytes()]),
    (("trajectories", 0, "tokens", 0), "<i8"),  # another dtype
    (("trajectories", 0, "tokens"), "not an array"),
    (("trajectories", 0, "behaviour_logprobs", 2), "not bytes"),
    (("trajectories", 0, "turns"), [[0, 9, "assistant", 1.0]]),  # runs past the tokens
    (("trajectories", 0, "turns"), [[0, 2, "narrator", 1.0]]),  # unknown role
    (("trajectories", 0, "turns"), [[0, 2]]),
    (("trajectories", 0, "status"), "exploded"),
    (("trajectories", 0, "group_id"), "another-group"),
    (("trajectories", 0, "unknown_field"), 1),
    (("trajectories",), []),
    (("trajectories",), "not a list"),
    (("trajectories", 1), "not a map"),
    (("group", "put_version"), "twelve"),
    (("group",), None),
])
def test_inconsistent_records_are_malformed(path, value):
    with pytest.raises(MalformedEntry):
        decode(_mutate(path, value))


def test_missing_fields_are_malformed():
    for key in ("tokens", "turns", "trajectory_id", "reward"):
        rec = record(full_group())
        del rec["trajectories"][0][key]
        with pytest.raises(MalformedEntry):
            decode(pack(rec))


def test_corrupted_bytes_decode_or_raise_malformed_only():
    """Random byte flips: either a valid group comes back or MalformedEntry; nothing else."""
    data = bytearray(encode(full_group()))
    rng = np.random.default_rng(1)
    for _ in range(400):
        bad = bytearray(data)
        for pos in rng.integers(0, len(bad), size=int(rng.integers(1, 4))):
            bad[pos] = int(rng.integers(0, 256))
        try:
            group = decode(bytes(bad))
        except MalformedEntry:
            continue
        group.validate()


# --- values, not only structure: each defect is MalformedEntry with its reason -------------------


def _with_array(index: int, name: str, values, dtype: str) -> bytes:
    array = np.asarray(values, dtype=dtype)
    return _mutate(("trajectories", index, name), [dtype, list(array.shape), array.tobytes()])


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("path,value,reason", [
    (("group", "put_version"), INF, "non_finite"),  # int(inf) raised OverflowError before
    (("group", "put_version"), NAN, "non_finite"),
    (("group", "put_version"), 1.5, "type"),
    (("group", "put_version"), True, "type"),
    (("group", "put_version"), -2, "range"),
    (("group", "put_version"), 2**40, "range"),
    (("group", "group_id"), 7, "type"),
    (("group", "extra"), 1, "schema"),
    (("trajectories", 0, "reward"), "abc", "type"),  # crashed the batcher before
    (("trajectories", 0, "reward"), NAN, "non_finite"),
    (("trajectories", 0, "reward"), -INF, "non_finite"),
    (("trajectories", 0, "reward"), None, "type"),
    (("trajectories", 0, "reward"), False, "type"),
    (("trajectories", 0, "turns"), [[0, 2, "assistant", NAN]], "non_finite"),
    (("trajectories", 0, "turns"), [[0, 2.0, "assistant", 1.0]], "type"),
    (("trajectories", 0, "timings"), {"started": INF}, "non_finite"),
    (("trajectories", 0, "timings"), {"started": "soon"}, "type"),
    (("trajectories", 0, "timings"), [1.0], "type"),
    (("trajectories", 0, "schema_version"), 2, "range"),
    (("trajectories", 0, "error"), 3, "type"),
    (("trajectories", 0, "sampling"), "hot", "type"),
])
def test_bad_values_are_malformed_with_their_reason(path, value, reason):
    with pytest.raises(MalformedEntry) as caught:
        decode(_mutate(path, value))
    assert caught.value.reason == reason, str(caught.value)


@pytest.mark.parametrize("name,values,dtype,reason", [
    ("behaviour_logprobs", [0, 0, NAN, -1.5, 0], "<f4", "non_finite"),
    ("behaviour_logprobs", [0, 0, -INF, -1.5, 0], "<f4", "non_finite"),
    ("tokens", [5, 9, -3, 7, 1], "<i4", "token_id"),
    ("policy_version", [-1, -1, -7, 5, -1], "<i4", "range"),
    ("tokens", [5, 9, 2, 7], "<i4", "shape"),  # 4 tokens, 5 of everything else
    ("tokens", [5, 9, 2, 7, 1], "<f4", "type"),  # floats where ids belong
])
def test_bad_arrays_are_malformed_with_their_reason(name, values, dtype, reason):
    with pytest.raises(MalformedEntry) as caught:
        decode(_with_array(0, name, values, dtype))
    assert caught.value.reason == reason, str(caught.value)


@pytest.mark.parametrize("name,values,reason", [
    ("behaviour_logprobs", [0, 0, NAN, -1.5, 0], "non_finite"),
    ("tokens", [5, 9, -3, 7, 1], "token_id"),
    ("policy_version", [-1, -1, -7, 5, -1], "range"),
])
def test_a_bad_value_is_found_and_named_in_any_trajectory(name, values, reason):
    """A group's arrays are checked at once: the defect of a later trajectory is still caught,
    and named by its trajectory."""
    group = full_group()
    ok = group.trajectories[0]
    dtype = getattr(ok, name).dtype
    group.trajectories = [ok, group.trajectories[1], dataclasses.replace(
        ok, trajectory_id="traj-2", **{name: np.asarray(values, dtype)})]
    with pytest.raises(MalformedEntry, match=f"trajectory 2.{name}") as caught:
        decode(encode(group))
    assert caught.value.reason == reason
    group.trajectories[2] = dataclasses.replace(ok, tokens=np.array([5, 9, 2, 7, 11], np.int32))
    with pytest.raises(MalformedEntry, match="trajectory 2.tokens: id 11 >= the model's"):
        check_tokens(decode(encode(group)), 10)


def test_token_ids_are_checked_against_the_vocabulary():
    group = decode(encode(full_group()))  # ids up to 9
    check_tokens(group, 10)
    with pytest.raises(MalformedEntry, match="id 9 >= the model's vocabulary 9") as caught:
        check_tokens(group, 9)
    assert caught.value.reason == "token_id"


def test_garbage_reasons_are_undecodable_or_schema():
    assert _reason(b"\xc1") == "undecodable"
    assert _reason(encode(full_group())[:-3]) == "undecodable"
    assert _reason(msgpack.packb({"v": SCHEMA_VERSION + 1})) == "schema"
    assert all(r in QUARANTINE_REASONS for r in (_reason(b"\xc1"), _reason(b"")))


def _reason(data: bytes) -> str:
    with pytest.raises(MalformedEntry) as caught:
        decode(data)
    return caught.value.reason
