"""Environments: the Gymnasium-style text API, built-ins and the latency wrapper (no JAX here)."""

from headrace.env.base import Env, EnvError, EnvSpec, StepResult
from headrace.env.registry import BUILTINS, env_factory, resolve

__all__ = ["BUILTINS", "Env", "EnvError", "EnvSpec", "StepResult", "env_factory", "resolve"]
