"""Where metrics go: `metrics.jsonl`, TensorBoard event files, and the live terminal view."""

from __future__ import annotations

import json
import math
import pathlib
import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items()
            if not (isinstance(v, float) and not math.isfinite(v))}


class JsonlSink:
    """One JSON object per line: {"time": unix_s, "step": n, "<metric>": value, ...}."""

    def __init__(self, path: pathlib.Path):
        self._file = open(path, "a", buffering=1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"time": time.time(), "step": step, **_finite(metrics)}
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, directory: pathlib.Path):
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(str(directory))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in _finite(metrics).items():
            if isinstance(value, (int, float)):
                self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        self._writer.close()


LIVE_ROWS = (
    ("step", "learner/step", "{:.0f}"),
    ("reward", "reward/mean", "{:.3f}"),
    ("success (sampled)", "reward/success_rate", "{:.3f}"),
    ("success (greedy eval)", "eval/success_rate", "{:.3f}"),
    ("learner utilisation", "learner/utilization", "{:.3f}"),
    ("steps/s", "learner/steps_per_s", "{:.2f}"),
    # where the learner's time goes: waiting for data, per step (the rest is utilisation)
    ("learner wait for data (s/step)", "learner/wait_data_s_mean", "{:.3f}"),
    ("actors' rate (groups/s into the buffer)", "buffer/ingest_per_s", "{:.1f}"),
    ("buffer depth", "buffer/depth", "{:.0f}"),
    ("policy lag (mean)", "staleness/lag_mean", "{:.2f}"),
    ("dropped (lag/age)", None, None),
    ("dropped (uniform rewards)", "learner/dropped_uniform", "{:.0f}"),  # when asked for
    ("episodes", "actor/episodes", "{:.0f}"),
)


class LiveView:
    """A rich table on stderr, refreshed by `update`; `hint` shows one extra line (e.g. sizing)."""

    def __init__(self, title: str, enabled: bool = True):
        self.title = title
        self._console = Console(stderr=True)
        self._live = Live(console=self._console, auto_refresh=False) if enabled else None
        if self._live is not None:
            self._live.start()

    def update(self, metrics: dict[str, float], elapsed_s: float, hint: str = "") -> None:
        if self._live is None:
            return
        table = Table(title=f"{self.title}  ({elapsed_s:.0f} s)", show_header=False)
        for label, key, fmt in LIVE_ROWS:
            if key is None:
                value = (f"{metrics.get('staleness/dropped_lag', 0):.0f} / "
                         f"{metrics.get('staleness/dropped_age', 0):.0f}")
            else:
                raw = metrics.get(key)
                value = fmt.format(raw) if isinstance(raw, (int, float)) else "-"
            table.add_row(label, value)
        if hint:
            table.add_row("hint", hint)
        self._live.update(table, refresh=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
