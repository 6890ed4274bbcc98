"""The environment API: Gymnasium-style, text in and text out, JAX-free.

An environment is one episode at a time: `reset(seed)` starts a task (the same seed gives the same
task, so the G episodes of a group share it) and `step(action)` answers one policy turn. Work that
waits on I/O implements `astep` so one actor can run thousands of episodes concurrently; a blocking
`step` runs in a thread pool unless the environment says it is cheap (`blocking = False`).

Failure modes the actor handles for every environment: an exception from `reset`/`step`, or a step
slower than `env.step_timeout_s`, ends that episode with status `error` and is counted
(`env/errors`, `env/timeouts`); an action outside `spec.action_words` is the environment's to
reject: it ends the episode with reward 0 and `info["invalid_action"] = True`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any


class EnvError(ValueError):
    """An environment cannot be built from its name and arguments; the message says why."""


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """What the text layer and the sampler need to know about an environment."""

    # Words of a closed task vocabulary (one token each), or None for open text (byte tokenizer).
    vocabulary: tuple[str, ...] | None = None
    # The actions the policy may emit, if a closed set; the sampler may constrain decoding to them.
    action_words: tuple[str, ...] | None = None
    # Policy turns per episode at most (the episode is truncated after this many).
    max_turns: int = 1


StepResult = tuple[str, float, bool, bool, dict[str, Any]]


class Env(abc.ABC):
    """One text environment; not thread-safe (the actor gives each episode its own instance)."""

    spec: EnvSpec = EnvSpec()
    blocking: bool = True  # `step` may block (I/O, subprocess): run it in a thread pool

    @abc.abstractmethod
    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        """Starts the task `seed`; returns the first observation and an info dict."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Answers one action: (observation, reward, terminated, truncated, info)."""

    async def astep(self, action: str) -> StepResult:
        """Async form of `step`; environments that wait on I/O override it."""
        return self.step(action)

    @property
    def has_astep(self) -> bool:
        return type(self).astep is not Env.astep

    def close(self) -> None:
        """Releases what the environment holds (servers, sandboxes)."""
