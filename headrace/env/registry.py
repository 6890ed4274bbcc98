"""Builds environments from `env.name`: a built-in name or `module:Class`, no code change needed."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from headrace.config import EnvConfig, import_object
from headrace.env.base import Env, EnvError
from headrace.env.latency import LatencySampler, LatencyWrapper

BUILTINS: dict[str, str] = {
    "guess_number": "headrace.env.guess_number:GuessNumber",
    "tool_calculator": "headrace.env.tool_calculator:ToolCalculator",
    "http_tool": "headrace.env.http_tool:HttpCalculator",
    "python_exec": "headrace.env.python_exec:PythonExec",
    "gym": "headrace.env.gym_adapter:GymEnv",
}


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
