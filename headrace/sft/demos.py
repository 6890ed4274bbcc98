"""Demonstrations for the warm-up: from the environment's solver or a JSONL file, rendered exactly
as the actor renders an episode (see `headrace.sft` for the formats)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import pathlib
from typing import Any

from headrace.config import Config
from headrace.env.base import Env
from headrace.text.template import EpisodeRenderer, make_renderer, template_of
from headrace.text.tokenizers import Tokenizer, TokenizerError
from headrace.types import Group, Trajectory

log = logging.getLogger(__name__)

MESSAGE_ROLES = ("system", "user", "assistant", "tool")


class SftError(ValueError):
    """Demonstrations cannot be made or read; the message says why and how to fix it."""


@dataclasses.dataclass
class Demo:
    """One rendered demonstration."""

    renderer: EpisodeRenderer
    reward: float
    success: bool | None  # None when unknown (a transcript given as messages)
    task: str  # where it came from (seed or file line), for messages and ids


class ActionCoder:
    """The tokens the sampler would have to produce for an action text.

    Args:
      allowed: the token ids decoding is constrained to (each one ends the turn), or None.
      max_new_tokens: the most tokens the sampler generates per turn.
    """

    def __init__(self, tokenizer: Tokenizer, allowed: tuple[int, ...] | None, max_new_tokens: int):
        self.tokenizer = tokenizer
        self.allowed = None if allowed is None else set(allowed)
        self.max_new_tokens = max_new_tokens

    def encode(self, action: str, where: str) -> list[int]:
        """Raises SftError when the sampler could never produce `action`."""
        try:
            tokens = [int(t) for t in self.tokenizer.encode(action)]
        except TokenizerError as error:
            raise SftError(f"{where}: action {action!r}: {error}") from None
        if self.allowed is not None:
            if len(tokens) != 1 or tokens[0] not in self.allowed:
                raise SftError(f"{where}: action {action!r} is not one of the environment's action "
                               "words (decoding is constrained to them, one token per turn)")
            return tokens
        tokens.append(self.tokenizer.end_of_turn_id)
        if len(tokens) > self.max_new_tokens:
            raise SftError(f"{where}: action {action[:40]!r}... is {len(tokens)} tokens with "
                           f"<eos>, more than sampling.max_new_tokens={self.max_new_tokens}; "
                           "raise it")
        return tokens


def _step(env: Env, action: str):
    return asyncio.run(env.astep(action)) if env.has_astep else env.step(action)


def replay(env: Env, seed: int, actions: list[str], coder: ActionCoder, where: str) -> Demo:
    """Plays `actions` in `env` from `reset(seed)`, rendered as `run_episode` renders an episode.

    Raises:
      SftError: an action the sampler cannot produce, or more actions than the episode takes.
    """
    renderer = make_renderer(coder.tokenizer)
    obs, _ = env.reset(seed)
    renderer.add_observation(obs, first=True)
    reward, success, done = 0.0, False, False
    for i, action in enumerate(actions):
        if done or i >= env.spec.max_turns:
            raise SftError(f"{where}: the episode ended after {i} actions, {len(actions)} given")
        tokens = coder.encode(action, where)
        renderer.prompt()
        renderer.add_generated(tokens, [0.0] * len(tokens), 0)
        obs, r, terminated, truncated, info = _step(env, coder.tokenizer.decode(tokens))
        reward += r
        renderer.builder.reward_last_turn(r)
        success = bool(info.get("success", r > 0)) if terminated else False
        done = terminated or truncated
        if not done:
            renderer.add_observation(obs)
    return Demo(renderer, reward, success, where)


def from_messages(messages: Any, tokenizer: Tokenizer, coder: ActionCoder, where: str) -> Demo:
    """Renders a transcript given as messages (see the module docstring).

    Raises:
      SftError: not a list of {role, content} objects in a possible order, or no assistant turn.
    """
    if not isinstance(messages, list) or not messages:
        raise SftError(f"{where}: messages must be a non-empty list")
    for k, m in enumerate(messages):
        if not (isinstance(m, dict) and set(m) == {"role", "content"}
                and m["role"] in MESSAGE_ROLES and isinstance(m["content"], str)):
            raise SftError(f"{where}: message {k} must be {{\"role\": one of "
                           f"{'|'.join(MESSAGE_ROLES)}, \"content\": text}}, got {m!r}"[:300])
    template = template_of(tokenizer)
    if messages[0]["role"] == "system":
        template = dataclasses.replace(template, system=messages[0]["content"])
        messages = messages[1:]
    if not messages or messages[0]["role"] != "user":
        raise SftError(f"{where}: the first message (after a system one) must be the user's")
    if not any(m["role"] == "assistant" for m in messages):
        raise SftError(f"{where}: no assistant message: nothing to learn")
    renderer = make_renderer(tokenizer, template)
    try:
        renderer.add_observation(messages[0]["content"], first=True)
        for m in messages[1:]:
            if m["role"] == "system":
                raise SftError(f"{where}: a system message may only come first")
            if m["role"] == "assistant":
                tokens = coder.encode(m["content"], where)
                renderer.prompt()
                renderer.add_generated(tokens, [0.0] * len(tokens), 0)
            else:
                renderer.add_observation(m["content"], role=m["role"])
    except TokenizerError as error:
        raise SftError(f"{where}: {error}") from None
    return Demo(renderer, 0.0, None, where)


def read_jsonl(path: pathlib.Path, make_env, tokenizer: Tokenizer,
               coder: ActionCoder) -> list[Demo]:
    """Demonstrations from a JSONL file (both forms; see the module docstring).

    Raises:
      SftError: the file is missing or empty, or a line is malformed (the message names it).
    """
    try:
        lines = path.read_text().splitlines()
    except (FileNotFoundError, IsADirectoryError):
        raise SftError(f"sft.demos={str(path)!r}: no such file; give 'solver' or a JSONL file of "
                       "demonstrations (see docs/environments.md)") from None
    demos: list[Demo] = []
    env = make_env()
    try:
        for number, line in enumerate(lines, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except ValueError as error:
                raise SftError(f"{where}: not JSON ({error})") from None
            if isinstance(record, dict) and set(record) == {"seed", "actions"}:
                seed, actions = record["seed"], record["actions"]
                if not (isinstance(seed, int) and seed >= 0 and isinstance(actions, list)
                        and actions and all(isinstance(a, str) for a in actions)):
                    raise SftError(f"{where}: seed must be an integer >= 0 and actions a "
                                   "non-empty list of strings")
                demos.append(replay(env, seed, actions, coder, where))
            elif isinstance(record, dict) and set(record) == {"messages"}:
                demos.append(from_messages(record["messages"], tokenizer, coder, where))
            else:
                got = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise SftError(f"{where}: expected {{\"seed\", \"actions\"}} or "
                               f"{{\"messages\"}}, got {got}")
    finally:
        env.close()
    if not demos:
        raise SftError(f"sft.demos={str(path)!r}: holds no demonstration")
    return demos


def solver_demos(config: Config, make_env, coder: ActionCoder) -> tuple[list[Demo], int]:
    """(successful demonstrations, failures) from the environment's `solve`.

    Raises:
      SftError: the environment has no solver for this configuration.
    """
    env = make_env()
    solve = getattr(env, "solve", None)
    name = config.env.name
    hint = "give demonstrations as a file instead (sft.demos: PATH.jsonl)"
    demos, failures = [], 0
    try:
        if not callable(solve):
            raise SftError(f"env.name={name!r} has no demonstration solver (no solve(seed) "
                           f"method); {hint}")
        for i in range(config.sft.episodes):
            seed = config.sft.seed_base + i
            try:
                actions = list(solve(seed))
            except (NotImplementedError, ValueError) as error:  # NoSolver is a ValueError
                raise SftError(f"env.name={name!r}: no solver for task {seed}: {error}; "
                               f"{hint}") from None
            demo = replay(env, seed, actions, coder, f"solver seed {seed}")
            if demo.success:
                demos.append(demo)
            else:
                failures += 1
                log.warning("the solver's demonstration for seed %d did not succeed (reward "
                            "%.3f); skipped", seed, demo.reward)
    finally:
        env.close()
    if not demos:
        raise SftError(f"env.name={name!r}: none of the solver's {config.sft.episodes} "
                       "demonstrations succeeded")
    return demos, failures


def to_group(demo: Demo, index: int, env_name: str) -> Group:
    """A demonstration as a one-trajectory group (what the batcher packs)."""
    tokens, mask, logps, versions = demo.renderer.builder.arrays()
    gid = f"demo-{index}"
    trajectory = Trajectory(gid, gid, demo.task, env_name, "sft", tokens, mask, logps, versions,
                            demo.renderer.builder.turns, float(demo.reward))
    return Group(gid, demo.task, [trajectory], put_version=0)
