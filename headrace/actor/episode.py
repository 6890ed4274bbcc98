"""One episode: reset, then policy turn / environment step until done, recorded as a trajectory.

Failure modes, each ending the episode (never the actor) and counted: an exception from the
environment (`env/errors`, status error), a step slower than `step_timeout_s` (`env/timeouts`,
status error), a context too long for the sampler (`batch/truncated`, status truncated), an invalid
action (`env/invalid_actions`; the environment ends the episode with reward 0).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from headrace.actor.policy import BatchedPolicy
from headrace.env.base import Env
from headrace.metrics.core import Metrics
from headrace.model.sampler import PromptTooLong
from headrace.text.episode import EpisodeBuilder
from headrace.text.template import EpisodeRenderer
from headrace.text.tokenizers import Tokenizer
from headrace.types import STATUS_ERROR, STATUS_OK, STATUS_TRUNCATED

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EpisodeResult:
    builder: EpisodeBuilder
    reward: float
    success: bool
    status: str
    error: str | None
    timings: dict[str, float]


async def _step(env: Env, action: str):
    if env.has_astep:
        return await env.astep(action)
    if env.blocking:
        return await asyncio.to_thread(env.step, action)
    return env.step(action)


def trace_timings(calls: list[tuple[float, float, float, int]],
                  steps: list[tuple[float, float]]) -> dict[str, float]:
    """The per-turn stamps of a traced episode, flattened into its `timings` map.

    `infer.<i>.requested|started|finished|rows`: turn i's policy call (asked, batched call began,
    call ended, episodes in the call); `env.<i>.started|finished`: turn i's environment step.
    """
    out: dict[str, float] = {}
    for i, (requested, started, finished, rows) in enumerate(calls):
        out |= {f"infer.{i}.requested": requested, f"infer.{i}.started": started,
                f"infer.{i}.finished": finished, f"infer.{i}.rows": float(rows)}
    for i, (started, finished) in enumerate(steps):
        out |= {f"env.{i}.started": started, f"env.{i}.finished": finished}
    return out


async def run_episode(env: Env, seed: int, policy: BatchedPolicy, tokenizer: Tokenizer,
                      metrics: Metrics, step_timeout_s: float,
                      trace: bool = False) -> EpisodeResult:
    """Plays one episode; with `trace`, its timings also hold every turn's stamps.

    Turns are rendered with the chat template the tokenizer carries (`headrace.text.template`):
    the sampler is given `renderer.prompt()` and its tokens are recorded verbatim.
    """
    renderer = EpisodeRenderer(tokenizer)
    timings = {"started": time.time()}
    calls: list | None = [] if trace else None
    steps: list[tuple[float, float]] = []
    reward, success, status, error = 0.0, False, STATUS_OK, None
    inline = not env.blocking and not env.has_astep
    with policy.episode() as slot:
        try:
            obs, _ = await asyncio.to_thread(env.reset, seed) if env.blocking else env.reset(seed)
            renderer.add_observation(obs, first=True)
            for _ in range(env.spec.max_turns):
                tokens, logps, version = await policy.act(renderer.prompt(), calls, slot)
                renderer.add_generated(tokens, logps, version)
                start, started_at = time.perf_counter(), time.time()
                action = tokenizer.decode(tokens)
                if inline:  # microseconds of pure Python: nothing to wait for or time out
                    obs, r, terminated, truncated, info = env.step(action)
                else:
                    # asyncio.timeout arms one timer; wait_for would start a task per step
                    with policy.stepping_away():
                        async with asyncio.timeout(step_timeout_s):
                            obs, r, terminated, truncated, info = await _step(env, action)
                metrics.observe("actor/env_s", time.perf_counter() - start)
                if trace:
                    steps.append((started_at, time.time()))
                reward += r
                renderer.builder.reward_last_turn(r)
                success = bool(info.get("success", r > 0)) if terminated else False
                if info.get("invalid_action"):
                    metrics.count("env/invalid_actions")
                if terminated or truncated:
                    status = STATUS_TRUNCATED if truncated and not terminated else STATUS_OK
                    break
                renderer.add_observation(obs)
            else:
                status = STATUS_TRUNCATED
        except PromptTooLong as exc:
            status, error = STATUS_TRUNCATED, str(exc)
            metrics.count("batch/truncated")
        except TimeoutError:
            status, error = STATUS_ERROR, f"environment step exceeded {step_timeout_s} s"
            metrics.count("env/timeouts")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an environment bug ends this episode, never the actor
            status, error = STATUS_ERROR, f"{type(exc).__name__}: {exc}"
            metrics.count("env/errors")
            log.warning("episode (seed %d) failed: %s", seed, error)
    timings["finished"] = time.time()
    if trace:
        timings |= trace_timings(calls, steps)
    return EpisodeResult(renderer.builder, reward, success, status, error, timings)
