"""Versioned weight store: the contract and its backends."""

from headrace.weights.base import Params, VersionGone, WeightStore
from headrace.weights.directory import DirWeightStore, from_config
from headrace.weights.format import CorruptWeights
from headrace.weights.memory import MemoryWeightStore

__all__ = ["CorruptWeights", "DirWeightStore", "MemoryWeightStore", "Params", "VersionGone",
           "WeightStore", "from_config"]
