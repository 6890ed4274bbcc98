"""One episode: reset, then policy turn / environment step until done, recorded as a trajectory.

Failure modes, each ending the episode (never the actor) and counted: an exception from the
environment (`env/errors`, status error), a step slower than `step_timeout_s` or a reset slower
than `reset_timeout_s` (`env/timeouts`, status error; the result says `abandoned`: the call may
still run on its thread, so the caller must not use that environment again), a context too long
for the sampler (`actor/truncated`, status truncated), an invalid action (`env/invalid_actions`;
the environment ends the episode with reward 0), a Jinja chat template that raises on the
conversation (`text/template_errors`, status error). Counted without ending the episode: turns a
Jinja template cannot render incrementally (`text/render_mismatch`), control-token strings in
observations kept as text (`text/escaped_specials`) and, when it has tools, the tool calls in each
action (`text/tool_calls`) and malformed ones (`text/tool_call_errors`).
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
from headrace.text.jinja_template import ChatTemplateError
from headrace.text.template import make_renderer
from headrace.text.tokenizers import Tokenizer
from headrace.text.tools import parse_tool_calls
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
    abandoned: bool = False  # a timed-out call may still run on its thread: discard the env


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
                      trace: bool = False, reset_timeout_s: float | None = None) -> EpisodeResult:
    """Plays one episode; with `trace`, its timings also hold every turn's stamps.

    A blocking `reset` runs on a thread under `reset_timeout_s` (None: `step_timeout_s`).

    Turns are rendered with the chat template the tokenizer carries (`headrace.text.template`):
    the sampler is given `renderer.prompt()` and its tokens are recorded verbatim. Turns a Jinja
    template cannot render incrementally are counted as `text/render_mismatch`.
    """
    renderer = make_renderer(tokenizer)
    count_tools = bool(getattr(renderer.template, "tools", ()))  # a Jinja template with tools
    timings = {"started": time.time()}
    calls: list | None = [] if trace else None
    abandoned = False
    steps: list[tuple[float, float]] = []
    reward, success, status, error = 0.0, False, STATUS_OK, None
    inline = not env.blocking and not env.has_astep
    reset_timeout_s = step_timeout_s if reset_timeout_s is None else reset_timeout_s
    what = "reset"  # the call a TimeoutError interrupted
    with policy.episode() as slot:
        try:
            if env.blocking:
                async with asyncio.timeout(reset_timeout_s):
                    obs, _ = await asyncio.to_thread(env.reset, seed)
            else:
                obs, _ = env.reset(seed)
            what = "step"
            renderer.add_observation(obs, first=True)
            for _ in range(env.spec.max_turns):
                tokens, logps, version = await policy.act(renderer.prompt(), calls, slot)
                renderer.add_generated(tokens, logps, version)
                start, started_at = time.perf_counter(), time.time()
                action = tokenizer.decode(tokens)
                if count_tools:  # malformed calls are counted; the environment judges the text
                    tool_calls, tool_errors = parse_tool_calls(action)
                    metrics.count("text/tool_calls", len(tool_calls))
                    if tool_errors:
                        metrics.count("text/tool_call_errors", len(tool_errors))
                        log.debug("malformed tool call (seed %d): %s", seed, tool_errors[0])
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
            metrics.count("actor/truncated")
        except ChatTemplateError as exc:
            status, error = STATUS_ERROR, str(exc)
            metrics.count("text/template_errors")
            log.warning("episode (seed %d): %s", seed, error)
        except TimeoutError:
            limit = reset_timeout_s if what == "reset" else step_timeout_s
            status, error = STATUS_ERROR, f"environment {what} exceeded {limit} s"
            abandoned = True
            metrics.count("env/timeouts")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an environment bug ends this episode, never the actor
            status, error = STATUS_ERROR, f"{type(exc).__name__}: {exc}"
            metrics.count("env/errors")
            log.warning("episode (seed %d) failed: %s", seed, error)
    if renderer.mismatches:  # turns the template cannot render incrementally (jinja_render)
        metrics.count("text/render_mismatch", len(renderer.mismatches))
    if getattr(renderer, "escaped", 0):  # control tokens in observations, kept as plain text
        metrics.count("text/escaped_specials", renderer.escaped)
    timings["finished"] = time.time()
    if trace:
        timings |= trace_timings(calls, steps)
    return EpisodeResult(renderer.builder, reward, success, status, error, timings, abandoned)
