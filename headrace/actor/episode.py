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
from headrace.text.tokenizers import BOS, Tokenizer
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


async def run_episode(env: Env, seed: int, policy: BatchedPolicy, tokenizer: Tokenizer,
                      metrics: Metrics, step_timeout_s: float) -> EpisodeResult:
    builder = EpisodeBuilder()
    timings = {"started": time.time()}
    reward, success, status, error = 0.0, False, STATUS_OK, None
    inline = not env.blocking and not env.has_astep
    with policy.episode():
        try:
            obs, _ = await asyncio.to_thread(env.reset, seed) if env.blocking else env.reset(seed)
            builder.add_observation([BOS, *tokenizer.encode(obs)], role="user")
            for _ in range(env.spec.max_turns):
                tokens, logps, version = await policy.act(builder.context())
                builder.add_generated(tokens, logps, version)
                start = time.perf_counter()
                action = tokenizer.decode(tokens)
                if inline:  # microseconds of pure Python: nothing to wait for or time out
                    obs, r, terminated, truncated, info = env.step(action)
                else:
                    with policy.stepping_away():
                        obs, r, terminated, truncated, info = await asyncio.wait_for(
                            _step(env, action), step_timeout_s)
                metrics.observe("actor/env_s", time.perf_counter() - start)
                reward += r
                builder.reward_last_turn(r)
                success = bool(info.get("success", r > 0)) if terminated else False
                if info.get("invalid_action"):
                    metrics.count("env/invalid_actions")
                if terminated or truncated:
                    status = STATUS_TRUNCATED if truncated and not terminated else STATUS_OK
                    break
                builder.add_observation(tokenizer.encode(obs), role="user")
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
    return EpisodeResult(builder, reward, success, status, error, timings)
