"""reasoning_gym: procedural reasoning tasks from the `reasoning-gym` package, scored by its own scorers.

`env.kwargs: {dataset: NAME, ...}` names one of reasoning-gym's datasets (`basic_arithmetic`,
`chain_sum`, `leg_counting`, ... : `reasoning_gym.factory.DATASETS`); every key this class does not
take itself goes to that dataset's config (e.g. `{dataset: chain_sum, min_terms: 2, max_terms: 3}`).

The first observation is the dataset's question followed by one of reasoning-gym's own
instructions (`instruction`, default `default`), which ask for the final answer in
`<answer>...</answer>` tags. The answer is extracted as reasoning-gym documents
(`reasoning_gym.utils.extract_answer`: the last `<answer>` tag, stripped) and scored by the
dataset's `score_answer` (1.0 for a right answer; some datasets give partial credit). The reward
is that score, plus `format_reward` when the action holds an `<answer>` tag at all. `success` is
a score of 1.

Single-turn by default (`max_turns: 1`). With `tool: true` the policy may first call the project's
calculator (`headrace.env.tool_calculator.evaluate`, the same tool the `tool_calculator` env uses):
an action whose first line is `calc: EXPR` is answered `= VALUE` (or `error: WHY`), as a tool turn;
any other action is the final answer. After `max_turns` actions without an answer the episode is
truncated with reward 0.

Train and held-out tasks are disjoint. The dataset is built once per (dataset, config, seed) with
`eval_size + train_size` items: items `[0, eval_size)` are the held-out tasks (`eval_seeds()`,
what `headrace eval` and periodic evaluation play); a task seed at or above
`headrace.env.registry.ACTOR_SEEDS_START` (every actor's) is a training task, item
`eval_size + (seed - ACTOR_SEEDS_START) % train_size`, and a training item whose question equals
a held-out one is skipped for the next one (datasets with small task spaces repeat questions).

With `fallback: last_number`, an action without the tag answers with its last number (opt-in:
small models often state "5 + 9 = 14" and ignore the tag; reasoning-gym itself gives 0).

Info keys: success, score, answer (the extracted text, or None), tagged (an `<answer>` tag was
there), tool_calls, tool_error, held_out. Everything here is Python; no JAX.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import re
from typing import Any

from headrace.env.base import Env, EnvError, EnvSpec, StepResult
from headrace.env.registry import ACTOR_SEEDS_START
from headrace.env.tool_calculator import CalcError, evaluate

TOOL_HINT = ("You may use a calculator first: reply with one line `calc: EXPR` (integers and "
             "+ - * / // % ** ( )) and you will get `= VALUE` back. Then give the answer.")
LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
FALLBACKS = ("none", "last_number")
MAX_SKIPS = 64  # training items tried in a row before a colliding task space is an error


class _Tasks:
    """One dataset's items, split into held-out and training (cached per configuration)."""

    def __init__(self, name: str, config: dict[str, Any], seed: int, eval_size: int,
                 train_size: int):
        import reasoning_gym
        from reasoning_gym.factory import DATASETS

        if name not in DATASETS:
            close = difflib.get_close_matches(name, DATASETS, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise EnvError(f"reasoning_gym: dataset={name!r} is not a reasoning-gym dataset{hint}; "
                           f"known: {', '.join(sorted(DATASETS))}")
        _, config_cls = DATASETS[name]
        fields = sorted(f.name for f in dataclasses.fields(config_cls)
                        if f.name not in ("seed", "size"))
        unknown = sorted(set(config) - set(fields))
        if unknown:
            raise EnvError(f"reasoning_gym: env.kwargs {', '.join(unknown)} are not options of "
                           f"dataset {name!r}; its options: {', '.join(fields) or '(none)'}; the "
                           "env's own: dataset, seed, eval_size, train_size, tool, max_turns, "
                           "format_reward, instruction, fallback")
        try:
            self.dataset = reasoning_gym.create_dataset(name, **config, seed=seed,
                                                        size=eval_size + train_size)
        except (AssertionError, ValueError, TypeError) as error:
            raise EnvError(f"reasoning_gym: dataset {name!r} refuses env.kwargs "
                           f"{json.dumps(config, sort_keys=True)}: {error or type(error).__name__}"
                           ) from None
        self.eval_size, self.train_size = eval_size, train_size
        self.held_out = [self.dataset[i] for i in range(eval_size)]
        self.held_out_questions = frozenset(item["question"] for item in self.held_out)

    def item(self, seed: int) -> tuple[dict[str, Any], bool]:
        """(the item of task `seed`, whether it is held out)."""
        if seed < ACTOR_SEEDS_START:
            return self.held_out[seed % self.eval_size], True
        start = (seed - ACTOR_SEEDS_START) % self.train_size
        for skip in range(MAX_SKIPS):
            item = self.dataset[self.eval_size + (start + skip) % self.train_size]
            if item["question"] not in self.held_out_questions:
                return item, False
        raise EnvError(f"reasoning_gym: {MAX_SKIPS} training tasks in a row repeat held-out "
                       "questions: the dataset's task space is too small for eval_size "
                       f"{self.eval_size}; lower eval_size or make the task harder")


@functools.lru_cache(maxsize=16)
def _tasks(name: str, config_json: str, seed: int, eval_size: int, train_size: int) -> _Tasks:
    return _Tasks(name, json.loads(config_json), seed, eval_size, train_size)


class ReasoningGym(Env):
    """One reasoning-gym dataset as an environment (see the module docstring).

    Args:
      dataset: the reasoning-gym dataset name.
      seed: the dataset's seed (the same seed gives the same tasks in every process).
      eval_size: held-out tasks (>= 1).
      train_size: training tasks before the training stream wraps around (>= 1).
      tool: offer the calculator tool (multi-turn).
      max_turns: actions per episode (default 1, or 3 with the tool).
      format_reward: added to the reward when the action holds an `<answer>` tag (>= 0).
      fallback: where the action holds no `<answer>` tag: `none` (the default: no answer, score
        0, as reasoning-gym scores it) or `last_number` (the last number in the action is the
        answer: for small models that answer "5 + 9 = 14" without the tag).
      instruction: which of reasoning-gym's prompts (`reasoning_gym.utils.SYSTEM_PROMPTS`:
        default, direct, simple, chain_of_draft, DeepSeekZero) follows the question; all ask
        for the `<answer>` tag. `direct` asks for the bare answer (short episodes).
      **config: the dataset's own options.

    Raises:
      EnvError: an unknown dataset, an option the dataset does not have or refuses, or an
        argument of the env out of range; the message names it and what is allowed.
    """

    blocking = False  # item generation and scoring are pure Python, sub-millisecond
    env_name = "reasoning_gym"

    def __init__(self, dataset: str, seed: int = 0, eval_size: int = 256,
                 train_size: int = 1_000_000, tool: bool = False, max_turns: int | None = None,
                 format_reward: float = 0.0, instruction: str = "default",
                 fallback: str = "none", **config: Any):
        if not isinstance(dataset, str):
            raise EnvError(f"reasoning_gym: dataset={dataset!r} must be a dataset name")
        if type(seed) is not int or type(eval_size) is not int or type(train_size) is not int:
            raise EnvError(f"reasoning_gym: seed={seed!r}, eval_size={eval_size!r} and "
                           f"train_size={train_size!r} must be integers")
        if eval_size < 1 or train_size < 1:
            raise EnvError(f"reasoning_gym: eval_size={eval_size} and train_size={train_size} "
                           "must be >= 1")
        max_turns = (3 if tool else 1) if max_turns is None else max_turns
        if type(max_turns) is not int or max_turns < 1 or (tool and max_turns < 2):
            raise EnvError(f"reasoning_gym: max_turns={max_turns!r} must be an integer >= 1 "
                           "(>= 2 with tool: true, one call and one answer)")
        if not isinstance(format_reward, int | float) or format_reward < 0:
            raise EnvError(f"reasoning_gym: format_reward={format_reward!r} must be a number >= 0")
        if fallback not in FALLBACKS:
            raise EnvError(f"reasoning_gym: fallback={fallback!r} must be one of "
                           f"{', '.join(FALLBACKS)}")
        if "size" in config:
            raise EnvError("reasoning_gym: env.kwargs.size is not used: set eval_size (held-out "
                           "tasks) and train_size (training tasks) instead")
        try:
            config_json = json.dumps(config, sort_keys=True)
        except TypeError:
            raise EnvError(f"reasoning_gym: env.kwargs {config!r} must be plain values") from None
        from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

        if instruction not in SYSTEM_PROMPTS:
            raise EnvError(f"reasoning_gym: instruction={instruction!r} is not one of "
                           f"reasoning-gym's prompts: {', '.join(sorted(SYSTEM_PROMPTS))}")
        self.tasks = _tasks(dataset, config_json, seed, eval_size, train_size)
        self._extract = extract_answer
        self._instruction = SYSTEM_PROMPTS[instruction]
        self.tool, self.max_turns, self.format_reward = bool(tool), max_turns, float(format_reward)
        self.fallback = fallback
        self.spec = EnvSpec(vocabulary=None, action_words=None, max_turns=max_turns)
        self._item: dict[str, Any] = {}
        self._held_out = False
        self._turns = self._tool_calls = 0

    def eval_seeds(self) -> list[int]:
        """The held-out tasks: every one of `eval_size`, once."""
        return list(range(self.tasks.eval_size))

    def prompt(self, item: dict[str, Any]) -> str:
        """The first observation for an item: the question, then the answer-format instruction."""
        parts = [item["question"].strip(), self._instruction]
        if self.tool:
            parts.append(TOOL_HINT)
        return "\n\n".join(parts)

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self._item, self._held_out = self.tasks.item(seed)
        self._turns = self._tool_calls = 0
        return self.prompt(self._item), {"held_out": self._held_out}

    def score(self, action: str) -> tuple[float, str | None]:
        """(the dataset's score of the answer extracted from `action`, that answer)."""
        answer = self._extract(action)
        if answer is None and self.fallback == "last_number":
            numbers = LAST_NUMBER.findall(action)
            answer = numbers[-1] if numbers else None
        return float(self.tasks.dataset.score_answer(answer, self._item)), answer

    def step(self, action: str) -> StepResult:
        self._turns += 1
        first_line = action.strip().partition("\n")[0]
        command, sep, expr = first_line.partition(":")
        if self.tool and sep and command.strip().lower() == "calc" and "<answer>" not in action:
            self._tool_calls += 1
            try:
                observation, tool_error = f"= {evaluate(expr)}", False
            except CalcError as error:
                observation, tool_error = f"error: {error}", True
            info = self._info(success=False, score=0.0, answer=None, tool_error=tool_error)
            return observation, 0.0, False, self._turns >= self.max_turns, info
        score, answer = self.score(action)
        tagged = self._extract(action) is not None
        reward = score + (self.format_reward if tagged else 0.0)
        info = self._info(success=score >= 1.0, score=score, answer=answer, tagged=tagged,
                          tool_error=False)
        return ("correct" if score >= 1.0 else "wrong"), reward, True, False, info

    def _info(self, **values: Any) -> dict[str, Any]:
        return {**values, "tool_calls": self._tool_calls, "held_out": self._held_out}
