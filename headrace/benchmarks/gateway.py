"""`headrace bench gateway`: what the OpenAI-compatible gateway adds over the engine alone.

    headrace bench gateway [--quick] [--json] [--sessions 1,64,512] [--turns 3] [--model hf:DIR]

The engine is the built-in one (the sampler behind a `BatchedPolicy`, as the actors run it) on a
2-layer random Llama written offline (or `--model`), every program compiled before timing. At each
concurrency level N, N agents (in a separate client process, over HTTP with httpx, so the
clients' CPU is not charged to the server's loop; results come back as JSON) each open a session
and make `--turns` chat calls, each sending the history back. Then the same N x turns contexts, the
exact token ids the gateway recorded, are replayed against the engine alone: N coroutines calling
`generate` on the same loop. Reported per level:

  gateway_requests_per_s, engine_requests_per_s   calls completed per second of wall time
  gateway_p50_ms, gateway_p99_ms                  a call's latency at the client (HTTP included)
  engine_p50_ms, engine_p99_ms                    a call's latency at the engine
  added_p50_ms, added_p99_ms                      gateway minus engine, per quantile
  server_p50_ms, server_engine_p50_ms             the server's own timing of its calls: the
                                                  whole handler, and the engine wait inside it

and `sessions`, `turns`, `model`, `new_segments` (0: every history matched its record). Figures
from a loaded 2-core machine are orders of magnitude; the engine's own batching differs between
the two runs only by when calls arrive. `--quick` (the suite's test): levels 1 and 8, 2 turns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from headrace import benchlib

QUESTION = "What is 17 + 25? Answer with the number."


def _tiny_model(folder: pathlib.Path) -> str:
    from headrace.benchmarks import real

    return f"hf:{real.tiny_llama(folder)}"


# --- the client process -----------------------------------------------------------------------

async def _agents(url: str, sessions: int, turns: int) -> dict[str, Any]:
    import httpx

    latencies: list[float] = []
    limits = httpx.Limits(max_connections=sessions + 8, max_keepalive_connections=sessions + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def agent() -> None:
            session = (await client.post(f"{url}/sessions", json={})).raise_for_status().json()
            messages = [{"role": "user", "content": QUESTION}]
            for turn in range(turns):
                start = time.perf_counter()
                response = await client.post(f"{session['base_url']}/chat/completions",
                                             json={"model": "headrace", "messages": messages})
                latencies.append(time.perf_counter() - start)
                message = response.raise_for_status().json()["choices"][0]["message"]
                messages += [message, {"role": "user", "content": f"And plus {turn}?"}]
            await client.post(f"{url}/sessions/{session['id']}/reward", json={"reward": 0.0})

        start = time.perf_counter()
        await asyncio.gather(*[agent() for _ in range(sessions)])
        wall = time.perf_counter() - start
    return {"latencies": latencies, "wall_s": wall}


def client_main(url: str, sessions: int, turns: int) -> None:
    print(json.dumps(asyncio.run(_agents(url, sessions, turns))))


# --- the server side --------------------------------------------------------------------------

class _Loop:
    """The gateway's event loop on a thread of its own (the client process calls it)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 1800):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def _quantiles_ms(seconds: list[float]) -> tuple[float, float]:
    p50, p99 = np.quantile(np.asarray(seconds), [0.5, 0.99])
    return float(p50 * 1e3), float(p99 * 1e3)


def measure(model: str, levels: list[int], turns: int, max_new_tokens: int) -> dict[str, Any]:
    from headrace.actor.policy import BatchedPolicy
    from headrace.config import load
    from headrace.gateway.app import Server
    from headrace.gateway.runner import make_gateway, settings_from
    from headrace.metrics.core import Metrics
    from headrace.runtime import build

    config = load(data={"env": {"name": "reasoning_gym", "kwargs": {"dataset": "chain_sum",
                                                                     "eval_size": 4}},
                        "model": {"init_from": model},
                        "sampling": {"max_new_tokens": max_new_tokens},
                        "shapes": {"buckets": [128, 256]},
                        "actor": {"max_batch": max(levels), "envs_per_actor": max(levels)}})
    task = build.build_task(config)
    graphdef, params = build.init_params(config, task)
    sampler = build.make_sampler(config, task, graphdef, seed=0)
    sampler.set_params(params, 0)
    start = time.perf_counter()
    compiled = sampler.precompile()
    compile_s = time.perf_counter() - start
    loop, metrics = _Loop(), Metrics()

    async def setup():
        policy = BatchedPolicy(sampler, metrics, max_batch=config.actor.max_batch,
                               wait_s=config.actor.batch_wait_ms / 1e3)
        serving = asyncio.create_task(policy.serve())
        gateway = make_gateway(config, policy, task.tokenizer, metrics,
                               settings_from(config, {"model": "headrace", "strict": False,
                                                      "session_timeout_s": 600.0}))
        server = Server(gateway)
        await server.start()
        return gateway, server, serving

    gateway, server, serving = loop.run(setup())
    levels_out: dict[str, Any] = {}
    try:
        for n in levels:
            metrics.dists.clear()
            done = subprocess.run([sys.executable, "-m", __spec__.name, "--client",
                                   gateway.base_url, str(n), str(turns)], capture_output=True,
                                  text=True, timeout=1800, env=benchlib.child_env())
            if done.returncode != 0:
                raise RuntimeError(f"the client process failed: {done.stderr[-2000:]}")
            client = json.loads(done.stdout)
            server_s = metrics.distribution("gateway/request_s")
            inside_s = metrics.distribution("gateway/engine_s")
            contexts, new_segments = loop.run(_collect(gateway))
            engine = loop.run(_engine_alone(gateway.engine, contexts))
            g50, g99 = _quantiles_ms(client["latencies"])
            e50, e99 = _quantiles_ms(engine["latencies"])
            calls = len(client["latencies"])
            levels_out[str(n)] = {
                "sessions": n, "calls": calls, "new_segments": new_segments,
                "gateway_requests_per_s": calls / client["wall_s"],
                "engine_requests_per_s": len(engine["latencies"]) / engine["wall_s"],
                "gateway_p50_ms": g50, "gateway_p99_ms": g99,
                "engine_p50_ms": e50, "engine_p99_ms": e99,
                "added_p50_ms": g50 - e50, "added_p99_ms": g99 - e99,
                # the server's own timing of the same calls: whole handler, and its engine wait
                "server_p50_ms": server_s.quantiles((0.5,))[0] * 1e3,
                "server_engine_p50_ms": inside_s.quantiles((0.5,))[0] * 1e3}
    finally:
        async def teardown():
            await server.stop()
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)

        loop.run(teardown())
        loop.close()
        sampler.close()
    return {"model": model, "turns": turns, "max_new_tokens": max_new_tokens,
            "programs_compiled": compiled, "compile_s": compile_s, "levels": levels_out}


async def _collect(gateway) -> tuple[list[list[list[int]]], int]:
    """The ended sessions' recorded contexts (per session, in call order), forgotten; and how
    many segments they started because a history did not match."""
    sessions = [s for s in gateway.sessions.values() if s.ended.is_set()]
    contexts = [[c.prompt.tolist() for seg in s.record.segments for c in seg.calls]
                for s in sessions]
    for s in sessions:
        gateway.forget(s)
    return contexts, sum(s.record.new_segments for s in sessions)


async def _engine_alone(engine, contexts: list[list[list[int]]]) -> dict[str, Any]:
    """The recorded contexts replayed: one coroutine per session, its calls in order."""
    latencies: list[float] = []

    async def session(calls: list[list[int]]) -> None:
        handle = engine.open()
        try:
            for context in calls:
                start = time.perf_counter()
                await handle.generate(context)
                latencies.append(time.perf_counter() - start)
        finally:
            handle.close()

    start = time.perf_counter()
    await asyncio.gather(*[session(c) for c in contexts])
    return {"latencies": latencies, "wall_s": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--client"]:
        client_main(argv[1], int(argv[2]), int(argv[3]))
        return 0
    parser = argparse.ArgumentParser(prog="headrace bench gateway",
                                     parents=[benchlib.bench_parser()])
    parser.add_argument("--sessions", default=None, help="concurrency levels (default 1,64,512)")
    parser.add_argument("--turns", type=int, default=None, help="calls per session (default 3)")
    parser.add_argument("--model", default=None, help="hf:DIR or gguf:FILE (default: a tiny "
                        "random Llama written offline)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    levels = [int(x) for x in (args.sessions or ("1,8" if args.quick else "1,64,512")).split(",")]
    turns = args.turns or (2 if args.quick else 3)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _tiny_model(pathlib.Path(tmp) / "tiny-llama")
        result = measure(model, levels, turns, args.max_new_tokens)
    if not args.model:
        result["model"] = "tiny random Llama (2 layers, d 64)"
    result["quick"] = args.quick
    benchlib.emit(result, as_json=args.json, title="headrace bench gateway")
    return 0


if __name__ == "__main__":
    sys.exit(main())
