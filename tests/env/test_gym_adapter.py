"""gym adapter: closed vocabularies for CartPole and FrozenLake, solvers, invalid actions."""

from __future__ import annotations

import random

import pytest

from headrace.config import EnvConfig
from headrace.env.base import EnvError
from headrace.env.gym_adapter import GymEnv, NoSolver, _bfs
from headrace.env.registry import env_factory


def _play(env: GymEnv, actions) -> tuple[float, bool, bool, dict, list[str]]:
    total, seen = 0.0, []
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        total += reward
        seen.append(obs)
        if terminated or truncated:
            break
    return total, terminated, truncated, info, seen


def test_frozen_lake_words_and_bfs_solution():
    env = GymEnv(id="FrozenLake-v1", is_slippery=False)
    assert env.spec.action_words == ("left", "down", "right", "up")
    assert set(env.spec.vocabulary) == {f"s{i}" for i in range(16)} | set(env.spec.action_words)
    assert env.reset(0) == ("s0", {}) and not env.blocking and env.spec.max_turns == 100
    actions = env.solve(0)
    assert len(actions) == 6  # the shortest path on the 4x4 map
    total, terminated, truncated, info, seen = _play(env, actions)
    assert (total, terminated, info["success"], seen[-1]) == (1.0, True, True, "s15")


def test_frozen_lake_hole_and_slippery_has_no_solver():
    env = GymEnv(id="FrozenLake-v1", is_slippery=False)
    env.reset(0)
    total, terminated, _, info, seen = _play(env, ["right", "down"])  # s5 is a hole
    assert (total, terminated, info["success"], seen[-1]) == (0.0, True, False, "s5")
    slippery = GymEnv(id="FrozenLake-v1", is_slippery=True)
    assert len(slippery.env.unwrapped.P[0][1]) == 3  # the kwarg reached gymnasium
    with pytest.raises(NoSolver, match="deterministic"):
        slippery.solve(0)


def test_cartpole_binned_words_stay_in_the_vocabulary():
    env = GymEnv(id="CartPole-v1", bins=4)
    vocabulary = set(env.spec.vocabulary)
    assert env.spec.action_words == ("left", "right") and len(vocabulary) == 4 * 4 + 2
    assert env.reset(5) == env.reset(5)
    rng = random.Random(0)
    for seed in range(5):
        obs, _ = env.reset(seed)
        words = obs.split()
        assert len(words) == 4 and set(words) <= vocabulary
        for _ in range(200):
            obs, reward, terminated, truncated, info = env.step(rng.choice(["left", "right"]))
            assert set(obs.split()) <= vocabulary and reward == 1.0
            if terminated or truncated:
                assert info["success"] is (not terminated)
                break


def test_cartpole_solver_survives_to_the_limit():
    env = GymEnv(id="CartPole-v1")
    for seed in range(2):
        env.reset(seed)
        actions = env.solve(seed)
        total, terminated, truncated, info, _ = _play(env, actions)
        assert (len(actions), total, terminated, truncated) == (500, 500.0, False, True)
        assert info["success"]


def test_binning_ranges_and_unbounded_values():
    env = GymEnv(id="CartPole-v1", bins=2, obs_ranges={0: [-0.01, 0.01]})
    obs, _ = env.reset(0)
    x = env.env.unwrapped.state[0]
    assert obs.split()[0] == ("d0b1" if x >= 0 else "d0b0")
    render = env._render
    assert render([100.0, 0.0, 0.0, 0.0]).split()[0] == "d0b1"  # clipped to the last bin
    assert render([-100.0, 0.0, 0.0, 0.0]).split()[0] == "d0b0"


def test_other_spaces_blackjack_and_taxi():
    blackjack = GymEnv(id="Blackjack-v1")
    obs, _ = blackjack.reset(1)
    assert len(obs.split()) == 3 and set(obs.split()) <= set(blackjack.spec.vocabulary)
    assert blackjack.spec.action_words == ("stick", "hit")
    with pytest.raises(NoSolver, match="no solver"):
        blackjack.solve(1)
    taxi = GymEnv(id="Taxi-v4")
    taxi.reset(3)
    total, terminated, _, info, _ = _play(taxi, taxi.solve(3))
    assert terminated and info["success"] and total > 0


def test_invalid_action_ends_the_episode():
    env = GymEnv(id="FrozenLake-v1", is_slippery=False)
    env.reset(0)
    assert env.step("jump") == ("", 0.0, True, False, {"invalid_action": True, "success": False})


def test_turn_limit_and_custom_action_words():
    env = GymEnv(id="FrozenLake-v1", is_slippery=False, max_turns=3,
                 action_words=["W", "S", "E", "N"])
    env.reset(0)
    assert env.step("W")[3] is False and env.step("W")[3] is False
    obs, reward, terminated, truncated, info = env.step("W")
    assert truncated and not terminated and info["success"] is False


def test_bfs_reference_on_a_tiny_chain():
    # 0 -> 1 -> 2 (goal, reward 1); action 1 from 0 falls in a hole (done, reward 0).
    table = {0: {0: [(1.0, 1, 0.0, False)], 1: [(1.0, 3, 0.0, True)]},
             1: {0: [(1.0, 2, 1.0, True)], 1: [(1.0, 0, 0.0, False)]},
             2: {0: [(1.0, 2, 0.0, True)], 1: [(1.0, 2, 0.0, True)]},
             3: {0: [(1.0, 3, 0.0, True)], 1: [(1.0, 3, 0.0, True)]}}
    assert _bfs(table, 0) == [0, 0]
    table[0][0] = [(0.5, 1, 0.0, False), (0.5, 0, 0.0, False)]
    assert _bfs(table, 0) is None


@pytest.mark.parametrize("kwargs, message", [
    ({"id": "NoSuchEnv-v9"}, "gymnasium.make"),
    ({"id": "FrozenLake-v1", "bogus_kwarg": 1}, "gymnasium.make"),
    ({"id": "Pendulum-v1"}, "not Discrete"),
    ({"id": "CartPole-v1", "bins": 1}, "bins"),
    ({"id": "CartPole-v1", "action_words": ["a"]}, "distinct single words"),
])
def test_bad_arguments_fail_clearly(kwargs, message):
    with pytest.raises(EnvError, match=message):
        GymEnv(**kwargs)


def test_registry_builds_gym_envs():
    make = env_factory(EnvConfig(name="gym", kwargs={"id": "FrozenLake-v1",
                                                     "is_slippery": False}))
    env = make()
    assert isinstance(env, GymEnv) and env.reset(0)[0] == "s0"
    env.close()
