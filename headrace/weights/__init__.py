"""Versioned weight store: the contract and its backends."""

from headrace.weights.base import Params, VersionGone, WeightStore
from headrace.weights.memory import MemoryWeightStore

__all__ = ["MemoryWeightStore", "Params", "VersionGone", "WeightStore"]
