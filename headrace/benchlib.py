"""What every benchmark shares: the `--quick`/`--json` flags and one way to report a result.

A benchmark's `main(argv)` builds its parser with `parents=[bench_parser()]` and ends with
`emit(result, as_json=args.json, title=...)`: a readable table always goes to stderr; with `--json`,
stdout carries exactly one JSON object (the result) and nothing else, so `headrace bench NAME
--json | jq` works. Values must be JSON-serialisable (numbers, strings, nested dicts and lists);
NaN and infinities are written as null, since strict JSON has no spelling for them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
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
