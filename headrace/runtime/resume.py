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
again). `history` replays each process's files that way; `headrace.runtime.accounting` checks the
identity (docs/design.md, "Buffer contract"), written = trained ∪ dropped ∪ quarantined ∪ in
the buffer, exactly, by id.
"""

from __future__ import annotations

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
from headrace.rundir import RunDir
from headrace.types import Entry

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
    if (path / RunDir.RUN).exists():
        raise ConfigError(f"run.dir={config.run.dir!r}: {path} already holds a run; continue it "
                          f"with `headrace train --resume {path}` or choose another run.dir")


def start_run(run_dir: pathlib.Path, config: Config) -> str:
    """Writes RUN_DIR/run.json for a new run and returns its fresh run id."""
    run_id = uuid.uuid4().hex[:12]
    _write_json(run_dir / RunDir.RUN, {"run_id": run_id, "created": time.time(),
                                     "ledger": config.run.ledger, "resumes": []})
    return run_id


def read_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run record of RUN_DIR.

    Raises:
      ConfigError: RUN_DIR is not a run folder of the processes launcher (no readable run.json).
    """
    path = pathlib.Path(run_dir) / RunDir.RUN
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{run_dir}: not a resumable run folder (no {RunDir.RUN}; only runs of "
                          "the processes launcher, run.launcher=processes, can resume)") from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: unreadable run record ({error})") from None
    if not isinstance(record, dict) or not isinstance(record.get("run_id"), str):
        raise ConfigError(f"{path}: not a run record (no run_id)")
    return record


def load_config(run_dir: str | os.PathLike, overrides: Sequence[str] = ()) -> Config:
    """The config to resume RUN_DIR with: its config.yaml plus `overrides`, run in RUN_DIR by the
    processes launcher over Redis and its weight store (the directory one unless it was Redis).

    Raises:
      ConfigError: not a run folder, a bad override, or `run.ledger` changed (the ledger must
        cover the whole run or nothing).
    """
    run_dir = pathlib.Path(run_dir).absolute()
    record = read_run(run_dir)
    config = config_lib.load(run_dir / RunDir.CONFIG, overrides)
    if config.run.ledger != bool(record.get("ledger")):
        raise ConfigError(f"run.ledger={config.run.ledger}: this run started with "
                          f"run.ledger={bool(record.get('ledger'))}, which cannot change")
    weights = "dir" if config.weights.backend == "memory" else config.weights.backend
    launcher = "ray" if config.run.launcher == "ray" else "processes"  # threads keep no Redis
    return config_lib.replace(config, run={"dir": str(run_dir), "launcher": launcher},
                              buffer={"backend": "redis"}, weights={"backend": weights})


def check_resumable(run_dir: pathlib.Path, client, run_id: str) -> None:
    """Refuses to resume a run that would silently lose data: one without a checkpoint whose
    buffer has already let go of acknowledged entries (with `run.checkpoint_every: 0` the learner
    acknowledges after each step). Without a checkpoint and with nothing acknowledged, every
    entry comes back to the learner, which starts again from its initial weights; a warning says
    so.

    Args:
      client: a `redis.Redis` on the run's server (its append-only file reloaded).

    Raises:
      ConfigError: no checkpoint, and acknowledged entries are gone from the buffer.
    """
    import logging

    from headrace.buffer.redis_stream import RedisBuffer
    from headrace.learner.checkpoint import Checkpointer

    checkpointer = Checkpointer(run_dir / RunDir.CHECKPOINTS, keep=CHECKPOINTS_KEPT,
                                read_only=True)
    try:
        latest = checkpointer.latest_step()
    finally:
        checkpointer.close()
    if latest is not None:
        return
    buffer = RedisBuffer(client, run_id=run_id, consumer="resume-check", ledger=False)
    stats = buffer.stats()
    gone = buffer.added() - (buffer.depth() + buffer.pending()) - int(stats["buffer/quarantined"])
    if gone > 0:
        raise ConfigError(
            f"--resume {run_dir}: the run has no checkpoint, but {gone} groups were already "
            "trained and acknowledged (run.checkpoint_every=0 acknowledges after every step); "
            "resuming would start again from fresh weights without them. Start a new run "
            "instead, and keep run.checkpoint_every > 0 (the default) so a crash can resume")
    logging.getLogger(__name__).warning(
        "--resume %s: no checkpoint yet; nothing was acknowledged, so every entry comes back: "
        "the learner starts again from its initial weights", run_dir)


def begin_resume(run_dir: pathlib.Path, config: Config) -> str:
    """Records a resume in run.json, rewrites config.yaml, and returns the run id."""
    record = read_run(run_dir)
    record.setdefault("resumes", []).append({"time": time.time(),
                                             "max_steps": config.run.max_steps})
    _write_json(run_dir / RunDir.RUN, record)
    (run_dir / RunDir.CONFIG).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
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
    files = _ledger_files(pathlib.Path(run_dir, RunDir.LEDGER))
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
