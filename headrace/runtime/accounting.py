"""The accounting identity (docs/design.md), checked exactly, by group id, from a run's ledger.

written = trained + dropped (by reason) + quarantined + still in the buffer, with nothing lost and
nothing trained twice. `accounting` gathers the sets from the run folder (run.json, ledger/,
checkpoints/) and the run's Redis; `identity` turns them into the counts a report prints and
says whether the identity holds exactly. Both need a quiescent run: stopped, or every process of
it paused (SIGSTOP) while they read, so no put, ack or checkpoint lands between two reads. Used by
the crash tests and `headrace bench chaos`. With `buffer.shards` on one server every shard's stream,
quarantine and ledger are read (entry ids `S/ID`, as the learner saw them).
"""

from __future__ import annotations

import collections
import os
import pathlib
from typing import Any

from headrace.learner.gate import DROP_COUNTERS
from headrace.rundir import RunDir
from headrace.runtime.resume import CHECKPOINTS_KEPT, LedgerError, history, read_run


def _stream_groups(client, key: str, id_field: bytes | None = None) -> dict[str, str | None]:
    """entry id -> group id for every entry of a stream (None where the payload is malformed)."""
    from headrace.buffer.redis_stream import FIELD
    from headrace.buffer.serialize import MalformedEntry, decode

    out: dict[str, str | None] = {}
    start = "-"
    while True:
        page = client.xrange(key, start, "+", count=256)
        for raw_id, fields in page:
            entry_id = (fields.get(id_field) if id_field else raw_id).decode()
            try:
                out[entry_id] = decode(fields[FIELD]).group_id
            except (MalformedEntry, KeyError):  # a quarantined bad value: the group it names
                out[entry_id] = (fields.get(b"group_id") or b"").decode() or None
        if len(page) < 256:
            return out
        start = f"({page[-1][0].decode()}"


def _shard_count(run_dir: pathlib.Path) -> int:
    """The run's buffer shards, from RUN_DIR/config.yaml (1 when it says none).

    Raises:
      LedgerError: the shards are on several servers (`buffer.urls`): one client cannot read
        them; check each server's shard with `RedisBuffer`.
    """
    import yaml

    try:
        buffer = (yaml.safe_load((run_dir / RunDir.CONFIG).read_text()) or {}).get("buffer", {})
    except (OSError, yaml.YAMLError):
        return 1
    if len(buffer.get("urls") or ()) > 1:
        raise LedgerError(f"{run_dir}: the buffer's shards are on {len(buffer['urls'])} servers "
                          "(buffer.urls); this check reads one server")
    return int(buffer.get("shards") or 1)


def _ids(records: list[dict], kind: str) -> list[str]:
    return [g for r in records if r["kind"] == kind for g in r["groups"]]


def accounting(run_dir: str | os.PathLike, client) -> dict[str, Any]:
    """Checks the accounting identity of a run that kept a ledger, exactly, by group id.

    Args:
      run_dir: the run folder (run.json, ledger/, checkpoints/).
      client: a `redis.Redis` (bytes replies) on the run's server, e.g. a `RedisServer` restarted
        on RUN_DIR/redis.

    Returns:
      Sets of group ids: `written` (every group put; as many as `added`, the stream's count of
      puts, unless a writer ran without the ledger), `trained`, `dropped_by_reason` (reason ->
      set), `quarantined` (malformed ones count by `entry:<id>`), `in_buffer` (undelivered or
      pending), `missing` (written, and none of the others: lost), `trained_twice` (trained more
      than once, or trained and dropped, in what the checkpoints keep), `unrecorded` (seen but
      never recorded as written: a writer without the ledger), `redelivered` (handled with a
      delivery count > 1), `skipped` (redelivered and skipped: its checkpoint already covered
      it), `retrained` (trained, lost with a crash, trained again or still waiting); and
      `checkpoint` (the latest one's metadata) with `counter_mismatches` (name -> (counter in the
      checkpoint, count in the ledger)) for the counters that must survive a crash.

    Raises:
      LedgerError: the run kept no ledger, or the ledger contradicts the checkpoints.
    """
    from headrace.buffer.redis_stream import RedisBuffer
    from headrace.learner.checkpoint import Checkpointer

    run_dir = pathlib.Path(run_dir)
    record = read_run(run_dir)
    if not record.get("ledger"):
        raise LedgerError(f"{run_dir}: the run kept no ledger; start runs with run.ledger=true")
    checkpointer = Checkpointer(run_dir / RunDir.CHECKPOINTS, keep=CHECKPOINTS_KEPT,
                                read_only=True)
    try:
        latest = checkpointer.latest_step()
        metadata = checkpointer.read_metadata(latest) if latest is not None else {}
    finally:
        checkpointer.close()
    replay = history(run_dir, latest)

    shards = _shard_count(run_dir)
    buffers = [RedisBuffer(client, run_id=record["run_id"], consumer="accounting", shard=i,
                           ledger=False) for i in range(shards)]
    ids: dict[str, set[str]] = collections.defaultdict(set)
    stream: dict[str, str | None] = {}
    quarantine: dict[str, str | None] = {}
    written, added = set(), 0
    for index, buffer in enumerate(buffers):  # entry ids as the learner saw them: S/ID
        prefix = f"{index}/" if shards > 1 else ""
        for kind, entry_ids in buffer.all_ids().items():
            ids[kind].update(prefix + i for i in entry_ids)
        stream.update({prefix + i: g for i, g in _stream_groups(client, buffer.stream_key)
                       .items()})
        quarantine.update({prefix + i: g for i, g in _stream_groups(
            client, buffer.quarantine_key, id_field=b"id").items()})
        written |= buffer.written_group_ids()
        added += buffer.added()

    def groups(entry_ids) -> set[str]:
        return {stream.get(i) or f"entry:{i}" for i in entry_ids}

    trained_list = _ids(replay.effective, "trained")
    trained = set(trained_list)
    dropped: dict[str, set[str]] = collections.defaultdict(set)
    for r in replay.effective:
        if r["kind"] == "dropped":
            dropped[r["reason"]].update(r["groups"])
    all_dropped = set().union(*dropped.values()) if dropped else set()
    quarantined = {quarantine.get(i) or f"entry:{i}" for i in ids["quarantined"]}
    in_buffer = groups(ids["undelivered"] | ids["pending"])
    seen = trained | all_dropped | quarantined | in_buffer
    twice = {g for g, n in collections.Counter(trained_list).items() if n > 1}
    everything = replay.effective + replay.void
    redelivered = {g for r in everything
                   for g, d in zip(r["groups"], r["deliveries"], strict=True) if d > 1}

    counts = {"learner/groups": len(trained_list),
              "buffer/redelivered_skipped": len(_ids(replay.effective, "skipped"))}
    for reason, counter in DROP_COUNTERS.items():
        counts[counter] = sum(
            len(r["groups"]) for r in replay.effective
            if r["kind"] == "dropped" and r["reason"] == reason)
    counters = metadata.get("counters", {})
    mismatches = {name: (counters.get(name, 0), n) for name, n in counts.items()
                  if latest is not None and counters.get(name, 0) != n}
    return {
        "run_id": record["run_id"],
        "written": written,
        "added": added,
        "trained": trained,
        "dropped_by_reason": dict(dropped),
        "quarantined": quarantined,
        "in_buffer": in_buffer,
        "missing": written - seen,
        "trained_twice": twice | (trained & all_dropped),
        "unrecorded": {g for g in seen if not g.startswith("entry:")} - written,
        "redelivered": redelivered,
        "skipped": set(_ids(replay.effective, "skipped")),
        "retrained": set(_ids(replay.void, "trained")),
        "learner_starts": replay.starts,
        "checkpoint": metadata,
        "counter_mismatches": mismatches,
    }


def identity(result: dict[str, Any]) -> dict[str, Any]:
    """The counts of an `accounting` result and whether the identity holds exactly.

    A group handled by the learner (trained or dropped, in what the latest checkpoint keeps) may
    still sit in the buffer as pending when a crash came between the checkpoint and its
    acknowledgement; it counts as handled, not in the buffer (it is skipped when redelivered).
    The identity is exact when the parts are disjoint, their sizes add up to `written`, their
    union is `written`, nothing is lost or trained twice, and every group seen was recorded.

    Returns:
      `written`, `trained`, `dropped` (reason -> count), `quarantined`, `in_buffer`, `lost`,
      `trained_twice`, `unrecorded`, `identity_exact`.
    """
    trained = result["trained"]
    dropped = result["dropped_by_reason"]
    handled = trained.union(*dropped.values()) if dropped else set(trained)
    quarantined = result["quarantined"] - handled
    in_buffer = result["in_buffer"] - handled - quarantined
    parts = [trained, *dropped.values(), quarantined, in_buffer]
    named = [{g for g in part if not g.startswith("entry:")} for part in parts]  # not written
    total = sum(len(part) for part in named)  # by `put`: raw malformed bytes, named by entry id
    union = set().union(*named)
    written = result["written"]
    lost, twice = result["missing"], result["trained_twice"]
    exact = (total == len(written) and union == written and not lost and not twice
             and not result["unrecorded"])
    return {"written": len(written), "trained": len(trained),
            "dropped": {reason: len(ids) for reason, ids in sorted(dropped.items())},
            "quarantined": len(quarantined), "in_buffer": len(in_buffer), "lost": len(lost),
            "trained_twice": len(twice), "unrecorded": len(result["unrecorded"]),
            "identity_exact": exact}


def stopped_run_identity(run_dir: str | os.PathLike) -> dict[str, Any]:
    """`identity` of a run that has ended, on its Redis restarted from the append-only file in
    the run folder (started and stopped here)."""
    from headrace.buffer.server import RedisServer

    with RedisServer(pathlib.Path(run_dir) / RunDir.REDIS) as server:
        client = server.client(socket_timeout=30)
        try:
            return identity(accounting(run_dir, client))
        finally:
            client.close()
