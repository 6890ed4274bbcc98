"""Reading `metrics.jsonl` back: the one reader of what `sinks.JsonlSink` writes.

Each line is one snapshot, `{"time": unix_s, "step": n, "<metric>": value, ...}`; the file is
appended to (a resumed run adds to it). A process killed mid-write can leave its last line cut
short: that line is skipped and logged. Any other line that is not a JSON object is an error
naming the file and line, never a silent loss.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from typing import Any

from headrace.rundir import RunDir

log = logging.getLogger(__name__)

TAIL_BYTES = 1 << 16  # `last_record` reads this much of the file's end


def metrics_path(where: str | os.PathLike) -> pathlib.Path:
    """`where` itself when it is a file, else the run folder's metrics.jsonl."""
    path = pathlib.Path(where)
    return RunDir(path).metrics if path.is_dir() else path


def _parse(lines: list[str], path: pathlib.Path, first_line: int, complete: bool
           ) -> list[dict[str, Any]]:
    """Records of `lines`; the last one may be cut short unless `complete` (it ended in a
    newline)."""
    records = []
    for number, line in enumerate(lines, start=first_line):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif number == first_line + len(lines) - 1 and not complete:
            log.warning("%s:%d: skipped a last line cut short (%d characters)", path, number,
                        len(line))
        else:
            raise ValueError(f"{path}:{number}: not a metrics record (a JSON object); the file "
                             "was edited or written by something else")
    return records


def read_records(where: str | os.PathLike, *, missing_ok: bool = False) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl (`where`: the file or its run folder), in file order.

    Raises:
      FileNotFoundError: no such file (unless `missing_ok`: then []).
      ValueError: a line other than a cut-short last one is not a JSON object.
    """
    path = metrics_path(where)
    try:
        text = path.read_text()
    except FileNotFoundError:
        if missing_ok:
            return []
        raise
    return _parse(text.splitlines(), path, 1, text.endswith("\n"))


def last_record(where: str | os.PathLike) -> dict[str, Any] | None:
    """The newest complete record, reading only the file's last TAIL_BYTES (for polling a
    running job); None when the file is missing or holds none yet.

    Raises:
      ValueError: the newest complete line is not a JSON object.
    """
    path = metrics_path(where)
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            start = max(0, handle.tell() - TAIL_BYTES)
            handle.seek(start)
            text = handle.read().decode(errors="replace")
    except FileNotFoundError:
        return None
    lines = text.splitlines()
    if start > 0 and lines:
        lines = lines[1:]  # the first line read may be the end of a longer one
    if lines and not text.endswith("\n"):
        lines = lines[:-1]  # being written, or cut short
    newest = next((line for line in reversed(lines) if line.strip()), None)
    if newest is None:
        return None
    try:
        record = json.loads(newest)
    except json.JSONDecodeError:
        record = None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: its newest complete line is not a metrics record (a JSON "
                         "object); the file was edited or written by something else")
    return record
