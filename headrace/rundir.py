"""A run folder's layout: the one home of the names of what a run writes (docs/runtime.md).

    run = RunDir(config.run.dir)
    run.config, run.metrics, run.checkpoints          # RUN_DIR/config.yaml, metrics.jsonl, ...
    RunDir.CHECKPOINTS                                  # "checkpoints": for code that has a name

Nothing here touches the disk; the writers and readers of each file own what is in it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib


@dataclasses.dataclass(frozen=True)
class RunDir:
    """Named paths inside one run folder (`headrace train`, `headrace sft`, an audit)."""

    root: pathlib.Path

    CONFIG = "config.yaml"  # the run's full config, as validated
    METRICS = "metrics.jsonl"  # one JSON object per logged snapshot (`headrace.metrics.sinks`)
    SUMMARY = "summary.json"  # the final figures
    TENSORBOARD = "tensorboard"  # event files
    TRACES = "traces.jsonl"  # traced groups (`headrace.metrics.traces`)
    STAGES = "stages.json"  # stage distributions of every traced group
    AUDIT = "audit.json"  # `headrace audit`'s report
    AUDIT_PLOT = "audit.png"
    CHECKPOINTS = "checkpoints"  # Orbax checkpoints, one folder per step
    LEDGER = "ledger"  # what was done with each entry (`headrace.runtime.resume`)
    RUN = "run.json"  # the run's identity (run id, buffer shards) for a resume
    FAILURES = "failures"  # one file per failed process: its traceback
    WEIGHTS = "weights"  # the directory weight store, unless `weights.path` says where
    PINS = "eval_weights"  # the weights of each evaluation point
    REDIS = "redis"  # the embedded redis-server's data, config and log

    def __init__(self, root: str | os.PathLike):
        object.__setattr__(self, "root", pathlib.Path(root))

    def __truediv__(self, name: str) -> pathlib.Path:
        return self.root / name

    config = property(lambda self: self.root / self.CONFIG)
    metrics = property(lambda self: self.root / self.METRICS)
    summary = property(lambda self: self.root / self.SUMMARY)
    tensorboard = property(lambda self: self.root / self.TENSORBOARD)
    traces = property(lambda self: self.root / self.TRACES)
    stages = property(lambda self: self.root / self.STAGES)
    audit = property(lambda self: self.root / self.AUDIT)
    audit_plot = property(lambda self: self.root / self.AUDIT_PLOT)
    checkpoints = property(lambda self: self.root / self.CHECKPOINTS)
    ledger = property(lambda self: self.root / self.LEDGER)
    run = property(lambda self: self.root / self.RUN)
    failures = property(lambda self: self.root / self.FAILURES)
    weights = property(lambda self: self.root / self.WEIGHTS)
    pins = property(lambda self: self.root / self.PINS)
    redis = property(lambda self: self.root / self.REDIS)
