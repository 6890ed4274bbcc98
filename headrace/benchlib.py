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
import pathlib
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from headrace.types import Group, Trajectory, Turn

# The example configs ship in the package, next to the benchmarks: a wheel runs them anywhere.
EXAMPLES = pathlib.Path(__file__).resolve().parent / "examples"
# guess_number at n=8 with 3 guesses, the small runs of the tests and of the cluster and chaos
# benches: greedy success over the 8 secrets moves in steps of 1/8, and 7/8 is the most 3 guesses
# can find. A policy blind to the hints plays one fixed sequence of guesses and wins at most 3 of 8;
# one whose every guess is a random pick from 1..8, fixed per history (as an untrained one is),
# wins 2.6 on average and 5 or more once in 85 (simulated). 5 of 8: the run learned. (Random +
# 0.3, 6 of 8, was the bar until runs on a loaded 2-core machine ended at 5/8: there 150 steps
# end at 5/8 to 7/8, idle at 7/8 by step 50.)
LEARNED_SUCCESS_N8 = 5 / 8


def child_env() -> dict[str, str]:
    """The environment for a benchmark's helper process (`python -m headrace.benchmarks.X`): this
    process's, with the folder that holds `headrace` first on PYTHONPATH (a checkout or a wheel's
    site-packages), so the child imports the same code."""
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}


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


BYTES_PER_TOKEN = 13  # int32 token + bool mask + float32 logprob + int32 version


def finish(result: dict, problems: Sequence[str], *, as_json: bool, title: str) -> int:
    """Reports `result` (`emit`), then each broken promise on stderr; the exit status (1 when any
    promise was broken)."""
    emit(result, as_json=as_json, title=title)
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 1 if problems else 0


def payload_group(index: int, payload_bytes: int, trajectories: int) -> Group:
    """A valid group of `trajectories` trajectories whose arrays total about `payload_bytes`
    (what a buffer or weight benchmark moves around)."""
    tokens = max(payload_bytes // (BYTES_PER_TOKEN * trajectories) - 8, 4)
    items = []
    for j in range(trajectories):
        items.append(Trajectory(
            trajectory_id=f"b{index}-{j}", group_id=f"b{index}", task_id=f"task{index}",
            env="bench", actor_id="bench", tokens=np.arange(tokens, dtype=np.int32),
            loss_mask=np.arange(tokens) >= tokens // 4,
            behaviour_logprobs=np.full(tokens, -0.5, np.float32),
            policy_version=np.zeros(tokens, np.int32),
            turns=[Turn(0, tokens // 4, "user"), Turn(tokens // 4, tokens, "assistant", 1.0)],
            reward=1.0, timings={"started": time.time()}))
    return Group(f"b{index}", f"task{index}", items)


def token_groups(count: int, vocab: int, seed: int, *, size: int = 4, max_len: int | None = None,
                 prompt_answer: tuple[int, int] | None = None) -> list[Group]:
    """`count` synthetic groups of `size` trajectories for a learner step: random tokens, a loss
    mask on the answer, behaviour log-probs near uniform, normal rewards. Lengths: fixed
    (`prompt_answer`: prompt and answer tokens), or random in [max_len / 4, max_len] with the
    first quarter as the prompt."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(count):
        items = []
        for j in range(size):
            if prompt_answer is None:
                n = int(rng.integers(max_len // 4, max_len + 1))
                prompt = n // 4
            else:
                prompt, n = prompt_answer[0], sum(prompt_answer)
            mask = np.arange(n) >= prompt
            items.append(Trajectory(
                trajectory_id=f"s{seed}.{g}.{j}", group_id=f"s{seed}.{g}", task_id=f"t{g}",
                env="bench", actor_id="bench",
                tokens=rng.integers(0, vocab, n).astype(np.int32), loss_mask=mask,
                behaviour_logprobs=np.where(mask, -np.log(vocab) + rng.normal(0, 0.3, n),
                                            0).astype(np.float32),
                policy_version=np.where(mask, 0, -1).astype(np.int32),
                turns=[Turn(0, prompt, "user"), Turn(prompt, n, "assistant", 0.0)],
                reward=float(rng.normal()), timings={"started": 0.0}))
        groups.append(Group(f"s{seed}.{g}", f"t{g}", items, put_version=0))
    return groups


def median_seconds(call, repeats: int) -> float:
    """The median wall time of `repeats` calls of `call()`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def tail_quantiles(samples: Sequence[float]) -> tuple[float, float, float]:
    """(p50, p99, p99.9) of `samples`; NaN each without samples."""
    if not samples:
        return (float("nan"),) * 3
    p50, p99, p999 = np.quantile(np.asarray(samples), [0.5, 0.99, 0.999])
    return float(p50), float(p99), float(p999)
