"""`env.name: gateway`: `headrace train` runs an OpenAI-API agent, its calls recorded as trajectories.

    env:
      name: gateway
      kwargs:
        agent: my_module:run_episode      # async fn(base_url, task, seed) -> reward; or null
        tasks: {name: reasoning_gym, kwargs: {dataset: chain_sum}}
        host: 127.0.0.1                    # loopback by default
        port: 0                            # 0: any free port
        token_env: ""                      # env var holding a bearer token (needed off loopback)
        session_timeout_s: 300             # a session with no call this long ends as an error
        strict: false                      # 400 for other sampling parameters (else counted)
        model: headrace                    # the name GET /v1/models lists

Each actor hosts one gateway (uvicorn on the actor's own event loop, so the agent's calls and
every other episode's are batched into the same sampler calls). An episode is a session: the
actor's group slot draws a task seed as for any environment; each of its G environments resets
the task environment (`tasks`, any env of open text) to that seed, opens a session and awaits
`agent(session_base_url, task, seed)` on the actor's loop, thousands concurrently. `task` is an
`AgentTask`: `prompt` (the task's first observation), `seed`, `name`, `info`, and `score(answer)`
(the task environment's reward for a final answer). The agent returns the episode's reward (a
number; None: the last `score`). Every segment of the session (`headrace.gateway.recording`)
becomes a trajectory with that reward, the G sessions' trajectories one group, written to the
buffer as the actor writes any group (admission, staleness and accounting unchanged).

With `agent: null` the agents run as their own processes: `POST /sessions` hands out the waiting
sessions (`{id, base_url, task, seed}`) and `POST /sessions/{id}/reward` ends one.

Failures: an agent that raises, or returns something other than a number, ends its session with
status error (`gateway/agent_errors`, logged); one that makes no call for `session_timeout_s` is
cancelled (`gateway/session_timeouts`). Evaluation (`headrace eval`, `run.eval_every`) plays the
task environment itself: `reset` and `step` are the task's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import os
import weakref
from typing import Any

from headrace.config import Config, ConfigError
from headrace.configtree import import_object
from headrace.env.base import Env, EnvError, StepResult
from headrace.gateway.engine import PolicyEngine
from headrace.gateway.service import Gateway, Settings
from headrace.types import STATUS_ERROR

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {"agent": None, "tasks": None, "host": "127.0.0.1", "port": 0,
                            "token_env": "", "session_timeout_s": 300.0, "strict": False,
                            "model": "headrace"}


def _options(kwargs: dict[str, Any], error: type[Exception]) -> dict[str, Any]:
    unknown = sorted(set(kwargs) - set(DEFAULTS))
    if unknown:
        raise error(f"env.kwargs {', '.join(unknown)}: not gateway options; they are "
                    f"{', '.join(DEFAULTS)}")
    options = {**DEFAULTS, **kwargs}
    if not isinstance(options["port"], int) or not 0 <= options["port"] < 65536:
        raise error(f"env.kwargs.port={options['port']!r}: an integer 0-65535 (0: any free)")
    timeout = options["session_timeout_s"]
    if not isinstance(timeout, int | float) or timeout <= 0:
        raise error(f"env.kwargs.session_timeout_s={timeout!r}: a number of seconds > 0")
    name = options["token_env"]
    options["token"] = ""
    if name:
        options["token"] = os.environ.get(name, "")
        if not options["token"]:
            raise error(f"env.kwargs.token_env={name!r}: the environment variable {name} is "
                        "unset or empty; export the bearer token there")
    return options


def gateway_options(config: Config) -> dict[str, Any]:
    """The gateway options of a config (`env.kwargs` with `env.name: gateway`, else defaults)."""
    kwargs = dict(config.env.kwargs) if config.env.name == "gateway" else {}
    return _options(kwargs, ConfigError)


def settings_from(config: Config, options: dict[str, Any]) -> Settings:
    return Settings(model=str(options["model"]), temperature=config.sampling.temperature,
                    top_p=config.sampling.top_p, strict=bool(options["strict"]),
                    session_timeout_s=float(options["session_timeout_s"]))


def make_gateway(config: Config | None, policy, tokenizer, metrics, settings: Settings) -> Gateway:
    """A gateway on the built-in sampler behind `policy` (a `BatchedPolicy`).

    Raises:
      ConfigError: the tokenizer carries no Jinja chat template.
    """
    try:
        return Gateway(PolicyEngine(policy), tokenizer, metrics, settings)
    except ValueError as error:
        raise ConfigError(str(error)) from None


@dataclasses.dataclass
class AgentTask:
    """What an agent is given for one episode (see the module docstring)."""

    name: str
    seed: int
    prompt: str
    info: dict[str, Any]
    env: Env = dataclasses.field(repr=False)
    reward: float | None = None  # the last `score`
    success: bool | None = None

    def score(self, answer: str) -> float:
        """The task environment's reward for `answer` (its step on that action)."""
        _, reward, _, _, info = self.env.step(answer)
        self.reward, self.success = float(reward), bool(info.get("success", reward > 0))
        return self.reward

    def public(self) -> dict[str, Any]:
        """The task as `POST /sessions` returns it."""
        return {"name": self.name, "seed": self.seed, "prompt": self.prompt}


def load_agent(spec: str):
    """The function `module:NAME` or `path/to/file.py:NAME` names (None when NAME is missing).

    Raises:
      EnvError: not of either form, or the module or file cannot be loaded.
    """
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise EnvError(f"env.kwargs.agent={spec!r}: give module:function or file.py:function")
    if not where.endswith(".py"):
        return import_object("env.kwargs.agent", spec, EnvError)
    import importlib.util
    import pathlib

    path = pathlib.Path(where)
    if not path.is_file():
        raise EnvError(f"env.kwargs.agent={spec!r}: no file {path.resolve()} (a relative path "
                       "is taken from the working directory)")
    module_spec = importlib.util.spec_from_file_location(f"headrace_agent_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        raise EnvError(f"env.kwargs.agent={spec!r}: {path} fails to load: "
                       f"{type(error).__name__}: {error}") from None
    return getattr(module, name, None)


class _Host:
    """One gateway per actor loop (per `BatchedPolicy`), started by the first episode."""

    def __init__(self):
        self.lock = asyncio.Lock()
        self.gateway: Gateway | None = None
        self.server = None


_HOSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class GatewayEnv(Env):
    """An environment whose episodes are an agent's sessions (see the module docstring)."""

    blocking = False
    env_name = "gateway"

    def __init__(self, **kwargs: Any):
        options = _options(kwargs, EnvError)
        self.options = options
        agent = options["agent"]
        self.agent = None
        if agent is not None:
            self.agent = load_agent(str(agent))
            if not inspect.iscoroutinefunction(self.agent):
                raise EnvError(f"env.kwargs.agent={agent!r}: must name an async function "
                               "(async def run(base_url, task, seed) -> reward)")
        tasks = options["tasks"]
        if not isinstance(tasks, dict) or not isinstance(tasks.get("name"), str) \
                or set(tasks) - {"name", "kwargs"}:
            raise EnvError(f"env.kwargs.tasks={tasks!r}: give {{name: ENV, kwargs: {{...}}}}, "
                           "the environment whose tasks the agent solves")
        if tasks["name"] == "gateway":
            raise EnvError("env.kwargs.tasks.name: the tasks cannot come from a gateway")
        from headrace.env.registry import resolve

        cls = resolve(tasks["name"])
        try:
            self.inner = cls(**dict(tasks.get("kwargs") or {}))
        except TypeError as error:
            raise EnvError(f"env.kwargs.tasks.kwargs do not fit {tasks['name']}: {error}") \
                from None
        if self.inner.spec.vocabulary is not None:
            raise EnvError(f"env.kwargs.tasks.name={tasks['name']!r}: a closed-vocabulary task; "
                           "the gateway serves open text")
        self.task_name = tasks["name"]
        self.spec = self.inner.spec
        self.blocking = self.inner.blocking
        self._policy = None

    # Evaluation plays the task environment itself.
    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        return self.inner.reset(seed)

    def step(self, action: str) -> StepResult:
        return self.inner.step(action)

    def eval_seeds(self) -> list[int]:
        seeds = getattr(self.inner, "eval_seeds", None)
        return seeds() if seeds is not None else list(range(64))

    async def _host(self, policy, tokenizer, metrics) -> Gateway:
        from headrace.gateway.app import Server

        host = _HOSTS.get(policy)
        if host is None:
            host = _HOSTS[policy] = _Host()
        async with host.lock:
            if host.gateway is None:
                settings = Settings(
                    model=str(self.options["model"]),
                    temperature=policy.sampler.settings.temperature,
                    top_p=policy.sampler.settings.top_p, strict=bool(self.options["strict"]),
                    session_timeout_s=float(self.options["session_timeout_s"]))
                gateway = make_gateway(None, policy, tokenizer, metrics, settings)
                if self.agent is None:
                    gateway.waiting = asyncio.Queue()
                server = Server(gateway, self.options["host"], self.options["port"],
                                self.options["token"])
                url = await server.start()
                log.warning("gateway listening on %s", url)
                host.gateway, host.server = gateway, server
        self._policy = policy
        return host.gateway

    async def play(self, seed: int, policy, tokenizer, metrics, trace: bool = False) -> list:
        """One session of the agent on task `seed`: its segments as episode results."""
        gateway = await self._host(policy, tokenizer, metrics)
        if self.inner.blocking:
            prompt, info = await asyncio.to_thread(self.inner.reset, seed)
        else:
            prompt, info = self.inner.reset(seed)
        task = AgentTask(self.task_name, seed, prompt, dict(info), self.inner)
        session = gateway.open_session(task=task.public(), seed=seed, scorer=task.score)
        try:
            if self.agent is None:
                gateway.waiting.put_nowait(session)
                await session.ended.wait()
            else:
                await self._run_agent(gateway, session, task, seed, metrics)
        except asyncio.CancelledError:
            gateway.end(session, status=STATUS_ERROR, error="the actor stopped")
            gateway.forget(session)
            raise
        gateway.forget(session)
        return session.results(task.success)

    async def _run_agent(self, gateway, session, task, seed, metrics) -> None:
        run = asyncio.ensure_future(self.agent(gateway.session_url(session), task, seed))
        session.on_expire = run.cancel
        try:
            reward = await run
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                run.cancel()
                raise
            return  # expired: `expire_idle` ended the session
        except Exception as error:  # the agent's bug ends its episode, never the actor
            metrics.count("gateway/agent_errors")
            log.warning("gateway: the agent failed on task %d: %s: %s", seed,
                        type(error).__name__, error)
            gateway.end(session, status=STATUS_ERROR, error=f"{type(error).__name__}: {error}")
            return
        if reward is None:
            reward = task.reward
        if not isinstance(reward, int | float) or isinstance(reward, bool):
            metrics.count("gateway/agent_errors")
            log.warning("gateway: the agent returned %r on task %d, not a number", reward, seed)
            gateway.end(session, status=STATUS_ERROR,
                        error=f"the agent returned {type(reward).__name__}, not a reward")
            return
        gateway.end(session, float(reward))

    async def aclose(self) -> None:
        """Stops this actor's gateway (the first call does; the others find it stopped)."""
        host = _HOSTS.get(self._policy) if self._policy is not None else None
        if host is not None and host.server is not None:
            server, host.server = host.server, None
            await server.stop()

    def close(self) -> None:
        self.inner.close()
