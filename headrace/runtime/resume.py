"""Crash safety in the run folder: the run record, the learner's ledger, resuming, accounting.

Run record. `RUN_DIR/run.json` names the run (`run_id`, which the Redis keys carry), whether it
keeps a ledger, and every resume. It is written once when a run starts; a run folder that holds
one is never started afresh, only resumed.

Resuming (`headrace train --resume RUN_DIR`). The config is `RUN_DIR/config.yaml` plus the given
overrides (rewritten to `config.yaml`, so the folder describes the run as it now runs); the
embedded Redis restarts on `RUN_DIR/redis` and reloads its append-only file; the learner restores
its latest checkpoint in `RUN_DIR/checkpoints` and publishes after the newest version in
`RUN_DIR/weights`; actors start afresh (they are stateless). With `buffer.fsync=everysec` a
machine crash can lose the last second of puts; `always` loses nothing that `put` returned.

Ledger (`run.ledger=true`, for tests and audits; it costs a Redis set member and a line per
group). Writers: each buffer put adds its group ids to the run's `written` set in the same Redis
transaction (`RedisBuffer`, exact under any crash). The learner appends what it did with each entry
to `RUN_DIR/ledger/learner-NNNN.jsonl` (one file per learner start; process K of several learner
processes writes `learner-NNNN-pK.jsonl`, its own sequence): `trained` (per step),
`dropped` (with the gate's reason), `skipped` (a redelivered entry its checkpoint already covers),
and, before each checkpoint save, a `checkpoint` marker followed by an fsync. A learner that
restored checkpoint K writes `restored: K` in its first line: every record after K's marker was
lost with the crash (those entries were never acknowledged, so they come back and are handled
again). `history` replays each process's files that way; `accounting` checks the identity of DESIGN.md,
written = trained ∪ dropped ∪ quarantined ∪ in the buffer, exactly, by group id.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import time
import uuid
from collections.abc import Sequence
from typing import Any

import yaml

from headrace import config as config_lib
from headrace.config import Config, ConfigError
from headrace.types import Entry

RUN_FILE = "run.json"
LEDGER_DIR = "ledger"
CHECKPOINT_DIR = "checkpoints"
CHECKPOINTS_KEPT = 3


class LedgerError(RuntimeError):
    """The ledger is missing, damaged, or disagrees with the checkpoints; the message says how."""


# --- the run record ------------------------------------------------------------------------------


def _write_json(path: pathlib.Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(json.dumps(data, indent=2))
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)


def check_new_run_dir(config: Config) -> None:
    """Refuses to start a fresh run in a folder that already holds one (it must be resumed).

    Raises:
      ConfigError: `run.dir` (without a `{time}` field) names a folder with a run.json.
    """
    if "{time}" in config.run.dir:
        return
    path = pathlib.Path(config.run.dir.format(env=config.env.name.replace(":", ".")))
    if (path / RUN_FILE).exists():
        raise ConfigError(f"run.dir={config.run.dir!r}: {path} already holds a run; continue it "
                          f"with `headrace train --resume {path}` or choose another run.dir")


def start_run(run_dir: pathlib.Path, config: Config) -> str:
    """Writes RUN_DIR/run.json for a new run and returns its fresh run id."""
    run_id = uuid.uuid4().hex[:12]
    _write_json(run_dir / RUN_FILE, {"run_id": run_id, "created": time.time(),
                                     "ledger": config.run.ledger, "resumes": []})
    return run_id


def read_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run record of RUN_DIR.

    Raises:
      ConfigError: RUN_DIR is not a run folder of the processes launcher (no readable run.json).
    """
    path = pathlib.Path(run_dir) / RUN_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{run_dir}: not a resumable run folder (no {RUN_FILE}; only runs of "
                          "the processes launcher, run.launcher=processes, can resume)") from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: unreadable run record ({error})") from None
    if not isinstance(record, dict) or not isinstance(record.get("run_id"), str):
        raise ConfigError(f"{path}: not a run record (no run_id)")
    return record


def load_config(run_dir: str | os.PathLike, overrides: Sequence[str] = ()) -> Config:
    """The config to resume RUN_DIR with: its config.yaml plus `overrides`, run in RUN_DIR by the
    processes launcher over Redis and the directory weight store.

    Raises:
      ConfigError: not a run folder, a bad override, or `run.ledger` changed (the ledger must
        cover the whole run or nothing).
    """
    run_dir = pathlib.Path(run_dir).absolute()
    record = read_run(run_dir)
    config = config_lib.load(run_dir / "config.yaml", overrides)
    if config.run.ledger != bool(record.get("ledger")):
        raise ConfigError(f"run.ledger={config.run.ledger}: this run started with "
                          f"run.ledger={bool(record.get('ledger'))}, which cannot change")
    return config_lib.replace(config, run={"dir": str(run_dir), "launcher": "processes"},
                              buffer={"backend": "redis"}, weights={"backend": "dir"})


def begin_resume(run_dir: pathlib.Path, config: Config) -> str:
    """Records a resume in run.json, rewrites config.yaml, and returns the run id."""
    record = read_run(run_dir)
    record.setdefault("resumes", []).append({"time": time.time(),
                                             "max_steps": config.run.max_steps})
    _write_json(run_dir / RUN_FILE, record)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    return record["run_id"]


# --- the learner's ledger ------------------------------------------------------------------------


class Ledger:
    """The learner's append-only record of what it did with each entry (module docstring).

    Records are buffered; `mark` makes everything so far durable (flush + fsync), and the learner
    calls it before each checkpoint save, so every entry a checkpoint covers is in the ledger
    before it can be acknowledged. Not thread-safe: the learner's training thread writes it.
    """

    def __init__(self, directory: str | os.PathLike, process: int | None = None):
        """`process`: this learner's index when the job has several learner processes."""
        self.directory = pathlib.Path(directory)
        self.process = process
        self.path: pathlib.Path | None = None
        self._file = None

    def begin(self, restored: int | None) -> None:
        """Opens a new file for this learner start, saying which checkpoint it restored."""
        self.directory.mkdir(parents=True, exist_ok=True)
        numbers = [number for process, number, _ in _ledger_files(self.directory)
                   if process == self.process]
        suffix = "" if self.process is None else f"-p{self.process}"
        self.path = self.directory / f"learner-{max(numbers, default=-1) + 1:04d}{suffix}.jsonl"
        self._file = open(self.path, "x")
        self._write({"kind": "start", "time": time.time(), "restored": restored,
                     "pid": os.getpid()})
        self._sync()
        fd = os.open(self.directory, os.O_RDONLY)  # the new file's name is durable too
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def record(self, kind: str, entries: Sequence[Entry], step: int,
               reason: str | None = None) -> None:
        """Appends `trained`, `dropped` (with `reason`) or `skipped` entries (not yet durable)."""
        line: dict[str, Any] = {"kind": kind, "step": step, "ids": [e.id for e in entries],
                                "groups": [e.group.group_id for e in entries],
                                "deliveries": [e.delivery_count for e in entries]}
        if reason is not None:
            line["reason"] = reason
        self._write(line)

    def mark(self, key: int, step: int) -> None:
        """Writes the marker of checkpoint `key` and makes the ledger durable up to it."""
        self._write({"kind": "checkpoint", "key": key, "step": step})
        self._sync()

    def close(self) -> None:
        if self._file is not None:
            self._sync()
            self._file.close()
            self._file = None

    def _write(self, line: dict) -> None:
        if self._file is None:
            raise LedgerError("Ledger.begin() was not called")
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def _sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())


@dataclasses.dataclass
class History:
    """The ledger replayed: what the kept checkpoints cover, and what crashes undid."""

    effective: list[dict]  # trained/dropped/skipped records the latest checkpoint covers
    void: list[dict]  # records made after the checkpoint a later start restored (lost updates)
    starts: int  # learner starts


def _read_lines(path: pathlib.Path) -> list[dict]:
    lines = path.read_text().split("\n")
    records = []
    for number, text in enumerate(lines, 1):
        if not text:
            continue
        try:
            records.append(json.loads(text))
        except ValueError:
            if number == len(lines):  # a line cut short by a crash (never covered by a marker)
                break
            raise LedgerError(f"{path}:{number}: not a JSON record") from None
    return records


def _ledger_files(directory: pathlib.Path) -> list[tuple[int | None, int, pathlib.Path]]:
    """(process, start number, path) of every ledger file; process None for a single learner."""
    found = []
    for path in directory.glob("learner-*.jsonl"):
        number, _, process = path.stem[len("learner-"):].partition("-p")
        if number.isdigit() and (not process or process.isdigit()):
            found.append((int(process) if process else None, int(number), path))
    return sorted(found, key=lambda f: (-1 if f[0] is None else f[0], f[1]))


def history(run_dir: str | os.PathLike, latest: int | None) -> History:
    """Replays RUN_DIR/ledger up to checkpoint `latest` (the newest complete one; None: none);
    with several learner processes, each one's files in turn (every process marks every
    checkpoint), the results joined.

    Raises:
      LedgerError: a start restored a checkpoint no earlier file marked, or `latest` is unmarked.
    """
    files = _ledger_files(pathlib.Path(run_dir, LEDGER_DIR))
    processes = list(dict.fromkeys(process for process, _, _ in files)) or [None]
    parts = [_replay([path for p, _, path in files if p == process], latest)
             for process in processes]
    return History([r for part in parts for r in part.effective],
                   [r for part in parts for r in part.void],
                   max(part.starts for part in parts))  # job starts: each process starts once


def _replay(files: list[pathlib.Path], latest: int | None) -> History:
    """One learner process's ledger files, in start order, replayed up to checkpoint `latest`."""
    effective: list[dict] = []
    void: list[dict] = []
    marks: dict[int, int] = {}

    def truncate(key: int | None, why: str) -> None:
        nonlocal effective, marks
        if key is None:
            cut = 0
        elif key in marks:
            cut = marks[key]
        else:
            raise LedgerError(f"{why} checkpoint {key}, which no ledger record marks; was the "
                              "ledger on for the whole run?")
        void.extend(effective[cut:])
        effective = effective[:cut]
        marks = {k: v for k, v in marks.items() if key is not None and k <= key}

    starts = 0
    for path in files:
        records = _read_lines(path)
        if not records or records[0].get("kind") != "start":
            continue  # died while opening its ledger: it did nothing
        starts += 1
        truncate(records[0]["restored"], f"{path.name} restored")
        for record in records[1:]:
            if record["kind"] == "checkpoint":
                marks[record["key"]] = len(effective)
            else:
                effective.append(record)
    truncate(latest, "the latest complete checkpoint is")
    return History(effective, void, starts)


# --- accounting ----------------------------------------------------------------------------------


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
            except (MalformedEntry, KeyError):
                out[entry_id] = None
        if len(page) < 256:
            return out
        start = f"({page[-1][0].decode()}"


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
    from headrace.runtime.checkpoint import Checkpointer

    run_dir = pathlib.Path(run_dir)
    record = read_run(run_dir)
    if not record.get("ledger"):
        raise LedgerError(f"{run_dir}: the run kept no ledger; start runs with run.ledger=true")
    checkpointer = Checkpointer(run_dir / CHECKPOINT_DIR, keep=CHECKPOINTS_KEPT)
    try:
        latest = checkpointer.latest_step()
        metadata = checkpointer.read_metadata(latest) if latest is not None else {}
    finally:
        checkpointer.close()
    replay = history(run_dir, latest)

    buffer = RedisBuffer(client, run_id=record["run_id"], consumer="accounting", ledger=False)
    ids = buffer.all_ids()
    stream = _stream_groups(client, buffer.stream_key)
    quarantine = _stream_groups(client, buffer.quarantine_key, id_field=b"id")
    written, added = buffer.written_group_ids(), buffer.added()

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
    for reason in ("lag", "age"):
        counts[f"staleness/dropped_{reason}"] = sum(
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
