"""Builds environments from `env.name`: a built-in name or `module:Class`, no code change needed."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from typing import Any

from headrace.config import EnvConfig
from headrace.configtree import import_object
from headrace.env.base import Env, EnvError
from headrace.env.latency import LatencySampler, LatencyWrapper

BUILTINS: dict[str, str] = {
    "guess_number": "headrace.env.guess_number:GuessNumber",
    "tool_calculator": "headrace.env.tool_calculator:ToolCalculator",
    "http_tool": "headrace.env.http_tool:HttpCalculator",
    "python_exec": "headrace.env.python_exec:PythonExec",
    "gym": "headrace.env.gym_adapter:GymEnv",
    "reasoning_gym": "headrace.env.reasoning_gym:ReasoningGym",
    "gateway": "headrace.gateway.runner:GatewayEnv",  # runs OpenAI-API agents (docs/gateway.md)
}


# Task seeds. Each actor draws consecutive seeds from its own stream of TASKS_PER_STREAM; the
# stream is a stable digest of `run.seed` and the actor's id, so the same seed replays the same
# task stream in every process (Python's `hash` of a string is salted per process: not that).
# Evaluation uses seeds below ACTOR_SEEDS_START (`headrace.actor.evaluate`): held out from acting.
TASKS_PER_STREAM = 1_000_000
STREAM_BITS = 40  # streams per run: two actors share one with odds ~ 2**-40 per pair
ACTOR_SEEDS_START = 2 * 10**9  # every actor seed is >= this and < 2**63 (fits int64 seeds)


def task_seed_start(run_seed: int, actor_id: str) -> int:
    """The first task seed of actor `actor_id` in a run seeded `run_seed` (the same in every
    process and on every machine: a BLAKE2b digest, not Python's salted `hash`)."""
    digest = hashlib.blake2b(f"{run_seed}/{actor_id}".encode(), digest_size=8).digest()
    stream = int.from_bytes(digest, "little") >> (64 - STREAM_BITS)
    return ACTOR_SEEDS_START + stream * TASKS_PER_STREAM


def resolve(name: str) -> type[Env]:
    """The environment class for a built-in name or `module:Class`.

    Raises:
      EnvError: unknown name, module not importable, or the class is not an `Env`.
    """
    target = BUILTINS.get(name, name)
    if ":" not in target:
        raise EnvError(f"env.name={name!r}: not a built-in ({', '.join(sorted(BUILTINS))}) "
                       "and not of the form module:Class")
    module_name, _, class_name = target.partition(":")
    cls = import_object("env.name", target, EnvError)
    if not (inspect.isclass(cls) and issubclass(cls, Env)):
        raise EnvError(f"env.name={name!r}: {class_name} in {module_name} is not an "
                       "headrace.env.Env subclass")
    return cls


def env_factory(config: EnvConfig, seed: int = 0) -> Callable[[], Env]:
    """A function that builds one fresh environment per call (latency wrapper applied).

    Builds one instance eagerly so that bad arguments fail here, with a clear message.
    """
    cls = resolve(config.name)
    kwargs: dict[str, Any] = dict(config.kwargs)
    counter = iter(range(1 << 62))

    def make() -> Env:
        try:
            env = cls(**kwargs)
        except TypeError as error:
            raise EnvError(f"env.kwargs={kwargs!r} do not fit {config.name}: {error}") from None
        if config.latency.kind != "none":
            env = LatencyWrapper(env, LatencySampler(config.latency, seed * 1_000_003 + next(counter)))
        return env

    make().close()
    return make
