"""`headrace serve CONFIG [--port N]`: the gateway on its own, serving the config's policy.

The policy is the config's model (`model.init_from`, a checkpoint or a run folder, else fresh
weights) at version 0, sampled as `sampling` says, through the same sampler and `BatchedPolicy`
the actors use. The first line on stdout is the base URL (`http://HOST:PORT`, the port chosen by
the system with `--port 0`); agents use `BASE/v1` or a session's `BASE/sessions/{id}/v1`.
Gateway options come from `env.kwargs` when `env.name` is `gateway` (host, port, token_env,
strict, session_timeout_s). Sessions are recorded exactly as in training; with `--record FILE`
each ended session's trajectories are appended to FILE as JSON lines (tokens, loss mask,
behaviour log-probs, policy versions, reward), else they are counted and let go. Training through
agents that run as their own processes is `headrace train` with `env.name: gateway` and no
`agent` (they claim sessions with `POST /sessions`).

Stops on SIGINT / SIGTERM (or `stop`, a threading.Event), closing the server first.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
from typing import Any

from headrace.config import Config
from headrace.gateway.runner import gateway_options, make_gateway, settings_from
from headrace.metrics.core import Metrics
from headrace.runtime import build


def _record_line(session) -> str:
    rows = []
    for result in session.results():
        tokens, mask, logps, versions = result.builder.arrays()
        rows.append({"tokens": tokens.tolist(), "loss_mask": mask.astype(int).tolist(),
                     "behaviour_logprobs": logps.tolist(), "policy_version": versions.tolist(),
                     "reward": result.reward, "status": result.status})
    return json.dumps({"session": session.id, "reward": session.reward, "status": session.status,
                       "segments": rows})


async def _serve(config: Config, port: int | None, record: str | None,
                 stop: threading.Event, out) -> dict[str, Any]:
    from headrace.actor.policy import BatchedPolicy
    from headrace.gateway.app import Server

    options = gateway_options(config)
    if port is not None:
        options["port"] = port
    task = build.build_task(config)
    graphdef, params = build.init_params(config, task)
    sampler = build.make_sampler(config, task, graphdef, seed=config.run.seed, acting=True)
    sampler.set_params(params, 0)
    metrics = Metrics()
    policy = BatchedPolicy(sampler, metrics, max_batch=config.actor.max_batch,
                           wait_s=config.actor.batch_wait_ms / 1e3)
    serving = asyncio.create_task(policy.serve())
    gateway = make_gateway(config, policy, task.tokenizer, metrics, settings_from(config, options))
    server = Server(gateway, options["host"], options["port"], options["token"])
    ended: list = []
    try:
        url = await server.start()
        print(url, file=out, flush=True)
        sink = open(record, "a", encoding="utf-8") if record else None  # noqa: SIM115
        try:
            while not stop.is_set():
                await asyncio.sleep(0.1)
                for session in [s for s in gateway.sessions.values() if s.ended.is_set()]:
                    gateway.forget(session)
                    ended.append(session.id)
                    if sink is not None:
                        sink.write(_record_line(session) + "\n")
                        sink.flush()
        finally:
            if sink is not None:
                sink.close()
    finally:
        await server.stop()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        policy.close()
    return {"sessions": len(ended), **{k: v for k, v in metrics.snapshot().items()
                                       if k.startswith("gateway/")}}


def serve(config: Config, port: int | None = None, record: str | None = None,
          stop: threading.Event | None = None, out=sys.stdout) -> dict[str, Any]:
    """Serves until stopped; returns the gateway's counters (see the module docstring).

    Raises:
      ConfigError / GatewayConfigError: a config the gateway cannot serve.
    """
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
    return asyncio.run(_serve(config, port, record, stop, out))
