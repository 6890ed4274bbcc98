"""What every benchmark shares: the `--quick`/`--json` flags and one way to report a result.

A benchmark's `main(argv)` builds its parser with `parents=[bench_parser()]` and ends with
`emit(result, as_json=args.json, title=...)`: a readable table always goes to stderr; with `--json`,
stdout carries exactly one JSON object (the result) and nothing else, so `headrace bench NAME
--json | jq` works. Values must be JSON-serialisable (numbers, strings, nested dicts and lists);
NaN and infinities are written as null, since strict JSON has no spelling for them.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table


def bench_parser() -> argparse.ArgumentParser:
    """The parent parser of every benchmark: `--quick` (a seconds-long smoke run) and `--json`."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--quick", action="store_true",
                        help="a seconds-long smoke run (what the tests use)")
    parser.add_argument("--json", action="store_true",
                        help="print exactly one JSON object on stdout (tables go to stderr)")
    return parser


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # NumPy scalars
        return _clean(value.item())
    return value


def _rows(result: dict, prefix: str = "") -> list[tuple[str, str]]:
    rows = []
    for key, value in result.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows.extend(_rows(value, f"{name}."))
        elif isinstance(value, float):
            rows.append((name, f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"))
        else:
            rows.append((name, str(value)))
    return rows


def emit(result: dict, *, as_json: bool, title: str) -> None:
    """Reports a benchmark result: a table on stderr; with `as_json`, one JSON object on stdout.

    Raises:
      TypeError: the result holds a value JSON cannot represent.
    """
    result = _clean(result)
    text = json.dumps(result, sort_keys=False, allow_nan=False) if as_json else None
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in _rows(result):
        table.add_row(name, value)
    Console(file=sys.stderr).print(table)
    if text is not None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


class StealClock:
    """Time the hypervisor took from some cores (the steal column of /proc/stat), sampled twice a
    second on a thread while in use, so a benchmark can say how much of a measured window the
    machine took away from the process it measures. All zeros where /proc/stat is missing."""

    def __init__(self, cpus: Sequence[int] = (), every_s: float = 0.5):
        self._names = {f"cpu{c}" for c in cpus} or {"cpu"}
        self._every_s = every_s
        self._times: list[float] = []
        self._steal: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="steal-clock", daemon=True)

    def _read(self) -> float:
        """Seconds stolen from the cores since boot."""
        try:
            with open("/proc/stat") as f:
                lines = [line.split() for line in f if line.startswith("cpu")]
        except OSError:
            return 0.0
        ticks = sum(int(fields[8]) for fields in lines if fields[0] in self._names)
        return ticks / os.sysconf("SC_CLK_TCK")

    def _sample(self) -> None:
        self._times.append(time.time())
        self._steal.append(self._read())

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self._sample()

    def __enter__(self) -> StealClock:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def stolen_s(self, start: float, end: float) -> float:
        """Seconds stolen between the samples nearest `start` and `end` (wall-clock times)."""
        if not self._times or not start < end:
            return 0.0

        def at(t: float) -> float:
            i = min(bisect.bisect_left(self._times, t), len(self._times) - 1)
            return self._steal[i]

        return at(end) - at(start)
