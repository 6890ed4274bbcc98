"""gym: any Gymnasium environment with discrete actions, as text over a small closed vocabulary.

`GymEnv(id="FrozenLake-v1", is_slippery=False)` (in a config: `env.name: gym`, `env.kwargs: {id:
FrozenLake-v1, is_slippery: false}`; kwargs the adapter does not know go to `gymnasium.make`).

Observations become words, one per observation dimension, separated by spaces:

- `Discrete(n)`: the state index as `s5` (FrozenLake, CliffWalking, Taxi);
- `Box`: each of its (at most 64) values cut into `bins` equal bins as `d{i}b{k}`, e.g. CartPole
  `d0b2 d1b1 d2b2 d3b0`; bounds come from `obs_ranges` (index -> [low, high]), else a built-in
  table (CartPole), else the space's finite bounds; an unbounded value is binned as tanh(value);
- `MultiDiscrete` and `Tuple` of `Discrete`: `d{i}v{k}` (Blackjack).

Actions are words of `spec.action_words`: named for the common environments (CartPole `left`
`right`, FrozenLake `left` `down` `right` `up`, ...), else `a0`..`a{n-1}`, or `action_words` given.
A word outside them is an invalid action (reward 0, episode over). The reward is Gymnasium's.
An episode is truncated by Gymnasium's time limit or after `max_turns` steps (default: the
registered `max_episode_steps`, else 200). `info["success"]` is set at the end where success is
defined (FrozenLake, CliffWalking, Taxi: reaching the goal; CartPole: surviving to the limit;
MountainCar, Acrobot: reaching the goal).

`solve(seed)`: tabular environments with a transition table `P` (FrozenLake, CliffWalking, Taxi)
get a breadth-first search over their deterministic transitions from the seed's start state to
the best terminal transition (so a slippery lake has none); CartPole gets a linear controller that
survives to 500 steps. Others raise NoSolver.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import numpy as np

from headrace.env.base import Env, EnvError, EnvSpec, StepResult

_ACTION_WORDS: dict[str, tuple[str, ...]] = {
    "CartPole": ("left", "right"),
    "FrozenLake": ("left", "down", "right", "up"),
    "FrozenLake8x8": ("left", "down", "right", "up"),
    "CliffWalking": ("up", "right", "down", "left"),
    "Taxi": ("south", "north", "east", "west", "pickup", "dropoff"),
    "MountainCar": ("left", "idle", "right"),
    "Acrobot": ("negative", "zero", "positive"),
    "Blackjack": ("stick", "hit"),
}
# Bounds for Box values the space leaves unbounded or too wide to bin usefully.
_OBS_RANGES: dict[str, dict[int, tuple[float, float]]] = {
    "CartPole": {0: (-2.4, 2.4), 1: (-3.0, 3.0), 2: (-0.2095, 0.2095), 3: (-3.5, 3.5)},
}
_GOAL_ON_TERMINATION = {"FrozenLake", "FrozenLake8x8", "CliffWalking", "Taxi", "MountainCar",
                        "Acrobot"}
_SURVIVE_TO_LIMIT = {"CartPole"}
MAX_BOX_DIMS = 64


def _family(env_id: str) -> str:
    return env_id.split("/")[-1].rsplit("-v", 1)[0]



class NoSolver(ValueError):
    """The environment offers no demonstration solver (`solve`) for this task."""

class GymEnv(Env):
    """A Gymnasium environment behind the text API (see the module docstring).

    Args:
      id: the Gymnasium id, e.g. "CartPole-v1".
      bins: bins per Box value (2..32).
      obs_ranges: {index: [low, high]} overriding the bounds of Box values.
      action_words: names of the actions (one word each), in action order.
      max_turns: steps per episode at most.
      blocking: whether `step` may block; default: False for Gymnasium's toy-text and
        classic-control environments (microseconds), True otherwise.
      **gym_kwargs: passed to `gymnasium.make` (e.g. is_slippery, map_name).

    Raises:
      EnvError: unknown id, arguments `gymnasium.make` rejects, a non-discrete action space or
        an observation space the adapter cannot render.
    """

    def __init__(self, id: str = "FrozenLake-v1", bins: int = 4,
                 obs_ranges: dict[int, list[float]] | None = None,
                 action_words: list[str] | None = None, max_turns: int | None = None,
                 blocking: bool | None = None, **gym_kwargs: Any):
        import gymnasium

        self.id, self.family = id, _family(id)
        if not 2 <= bins <= 32:
            raise EnvError(f"gym {id}: bins={bins} must be in 2..32")
        self.gym_kwargs = gym_kwargs
        try:
            self.env = gymnasium.make(id, **gym_kwargs)
        except Exception as error:  # noqa: BLE001 - gymnasium raises many kinds; all mean "bad args"
            raise EnvError(f"gym: gymnasium.make({id!r}, **{gym_kwargs!r}) failed: "
                           f"{type(error).__name__}: {error}") from None
        space = self.env.action_space
        if not isinstance(space, gymnasium.spaces.Discrete):
            self.env.close()
            raise EnvError(f"gym {id}: action space {space} is not Discrete; only discrete "
                           "actions can be words")
        self._action_start = int(space.start)
        words = tuple(action_words or _ACTION_WORDS.get(self.family)
                      or (f"a{i}" for i in range(int(space.n))))
        if len(words) != space.n or len(set(words)) != len(words) or any(
                not w or w != w.strip() or " " in w for w in words):
            self.env.close()
            raise EnvError(f"gym {id}: action_words={list(words)} must be {space.n} distinct "
                           "single words")
        self._render, obs_words = self._renderer(gymnasium.spaces, bins, obs_ranges or {})
        entry = str(getattr(self.env.spec, "entry_point", ""))
        cheap = entry.startswith(("gymnasium.envs.toy_text", "gymnasium.envs.classic_control"))
        self.blocking = (not cheap) if blocking is None else bool(blocking)
        limit = max_turns or getattr(self.env.spec, "max_episode_steps", None) or 200
        if limit < 1:
            raise EnvError(f"gym {id}: max_turns={max_turns} must be >= 1")
        self.max_turns = int(limit)
        vocabulary = tuple(dict.fromkeys(obs_words + words))
        self.spec = EnvSpec(vocabulary=vocabulary, action_words=words, max_turns=self.max_turns)
        self._turns = 0

    def _renderer(self, spaces, bins: int, obs_ranges: dict) -> tuple[Any, tuple[str, ...]]:
        """(observation -> text, every word it can produce) for this observation space."""
        space = self.env.observation_space
        if isinstance(space, spaces.Discrete):
            start = int(space.start)
            return (lambda obs: f"s{int(obs) - start}"), tuple(f"s{i}" for i in range(space.n))
        if isinstance(space, spaces.MultiDiscrete | spaces.Tuple):
            if isinstance(space, spaces.MultiDiscrete):
                sizes = [int(n) for n in np.ravel(space.nvec)]
                starts = [int(v) for v in np.ravel(getattr(space, "start", np.zeros(len(sizes))))]
            elif all(isinstance(s, spaces.Discrete) for s in space.spaces):
                sizes = [int(s.n) for s in space.spaces]
                starts = [int(s.start) for s in space.spaces]
            else:
                raise EnvError(f"gym {self.id}: observation space {space}: only Tuples of "
                               "Discrete spaces are supported")
            words = tuple(f"d{i}v{k}" for i, n in enumerate(sizes) for k in range(n))
            return (lambda obs: " ".join(f"d{i}v{int(v) - starts[i]}"
                                         for i, v in enumerate(np.ravel(np.asarray(obs))))), words
        if isinstance(space, spaces.Box):
            dims = int(np.prod(space.shape))
            if dims > MAX_BOX_DIMS:
                raise EnvError(f"gym {self.id}: a Box of {dims} values is too large to render "
                               f"as words (at most {MAX_BOX_DIMS})")
            low, high = np.ravel(space.low).astype(float), np.ravel(space.high).astype(float)
            table = {**_OBS_RANGES.get(self.family, {}),
                     **{int(k): tuple(v) for k, v in obs_ranges.items()}}
            squash = np.zeros(dims, bool)
            for i in range(dims):
                if i in table:
                    low[i], high[i] = table[i]
                elif not (math.isfinite(low[i]) and math.isfinite(high[i])):
                    squash[i], low[i], high[i] = True, -1.0, 1.0
                if not high[i] > low[i]:
                    raise EnvError(f"gym {self.id}: observation range {i} [{low[i]}, {high[i]}] "
                                   "is empty")

            def render(obs) -> str:
                values = np.ravel(np.asarray(obs, dtype=float))
                values = np.where(squash, np.tanh(values), values)
                index = np.floor((values - low) / (high - low) * bins).astype(int)
                return " ".join(f"d{i}b{k}" for i, k in enumerate(np.clip(index, 0, bins - 1)))

            return render, tuple(f"d{i}b{k}" for i in range(dims) for k in range(bins))
        raise EnvError(f"gym {self.id}: observation space {space} is not supported (Discrete, "
                       "Box, MultiDiscrete or a Tuple of Discrete)")

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        obs, _ = self.env.reset(seed=int(seed))
        self._turns = 0
        return self._render(obs), {}

    def step(self, action: str) -> StepResult:
        self._turns += 1
        word = action.strip()
        if word not in self.spec.action_words:
            return "", 0.0, True, False, {"invalid_action": True, "success": False}
        index = self.spec.action_words.index(word) + self._action_start
        obs, reward, terminated, truncated, _ = self.env.step(index)
        truncated = bool(truncated) or self._turns >= self.max_turns
        info: dict[str, Any] = {}
        if terminated or truncated:
            if self.family in _GOAL_ON_TERMINATION:
                info["success"] = bool(terminated) and self._reached_goal(float(reward))
            elif self.family in _SURVIVE_TO_LIMIT:
                info["success"] = not terminated
        return self._render(obs), float(reward), bool(terminated), truncated, info

    def _reached_goal(self, reward: float) -> bool:
        if self.family in ("FrozenLake", "FrozenLake8x8"):
            return reward > 0
        return True

    def solve(self, seed: int) -> list[str]:
        """The actions of a successful episode for `seed`, where a solver exists.

        Raises:
          NoSolver: no solver for this environment, or no deterministic path
            (e.g. a slippery FrozenLake).
        """
        import gymnasium

        env = gymnasium.make(self.id, **self.gym_kwargs)
        try:
            obs, _ = env.reset(seed=int(seed))
            if hasattr(env.unwrapped, "P") and isinstance(env.observation_space,
                                                          gymnasium.spaces.Discrete):
                path = _bfs(env.unwrapped.P, int(obs))
                if path is None:
                    raise NoSolver(f"gym {self.id}: no deterministic path to the goal "
                                              f"from state {int(obs)} (slippery?)")
                return [self.spec.action_words[a - self._action_start] for a in path]
            if self.family == "CartPole":
                return self._play(env, obs, lambda o: int(o[2] + 0.5 * o[3] + 0.01 * o[0]
                                                          + 0.1 * o[1] > 0))
        finally:
            env.close()
        raise NoSolver(f"gym {self.id}: no solver for this environment")

    def _play(self, env, obs, policy) -> list[str]:
        actions = []
        for _ in range(self.max_turns):
            action = policy(obs)
            actions.append(self.spec.action_words[action])
            obs, _, terminated, truncated, _ = env.step(action + self._action_start)
            if terminated or truncated:
                break
        return actions

    def close(self) -> None:
        self.env.close()


def _bfs(table: dict, start: int) -> list[int] | None:
    """Shortest action sequence from `start` to the best-rewarded terminal transition, moving
    only along deterministic transitions and never through another terminal one."""
    terminal_rewards = [r for moves in table.values() for outcomes in moves.values()
                        for _, _, r, done in outcomes if done]
    if not terminal_rewards:
        return None
    best = max(terminal_rewards)
    parents: dict[int, tuple[int, int] | None] = {start: None}
    queue = collections.deque([start])
    while queue:
        state = queue.popleft()
        for action, outcomes in sorted(table[state].items()):
            if len({(n, r, d) for _, n, r, d in outcomes}) != 1:
                continue  # stochastic move
            _, nxt, reward, done = outcomes[0]
            if done and reward == best:
                path = [action]
                while parents[state] is not None:
                    state, previous = parents[state]
                    path.append(previous)
                return path[::-1]
            if not done and nxt not in parents:
                parents[nxt] = (state, action)
                queue.append(nxt)
    return None
