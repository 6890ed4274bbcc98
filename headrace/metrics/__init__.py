"""Timers, counters and sinks (console, JSONL, TensorBoard)."""

from headrace.metrics.core import Distribution, Metrics, RateMeter

__all__ = ["Distribution", "Metrics", "RateMeter"]
