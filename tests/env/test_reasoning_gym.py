"""reasoning_gym: the split, the scorer and answer extraction, the calculator tool, the errors."""

from __future__ import annotations

import pytest

from headrace.config import EnvConfig
from headrace.env.base import EnvError
from headrace.env.reasoning_gym import ReasoningGym
from headrace.env.registry import ACTOR_SEEDS_START, env_factory, task_seed_start

SMALL = dict(dataset="chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=1)


def answer_of(env: ReasoningGym) -> str:
    return env._item["answer"]


def test_train_and_held_out_are_disjoint_even_in_a_small_task_space():
    # Two 1-digit terms: at most 2 * 100 distinct questions, so training items repeat held-out
    # questions often; none may reach training.
    env = ReasoningGym(**SMALL, eval_size=64)
    held = {env.reset(s)[0] for s in env.eval_seeds()}
    assert len(env.eval_seeds()) == 64 and len(held) > 40
    start = task_seed_start(0, "actor-0")
    train = {env.reset(s)[0] for s in range(start, start + 2000)}
    assert train and not held & train
    assert not env.reset(start)[1]["held_out"] and env.reset(0)[1]["held_out"]


def test_same_seed_same_task_across_instances_and_dataset_seed_changes_it():
    a, b = ReasoningGym(dataset="leg_counting"), ReasoningGym(dataset="leg_counting")
    for seed in (0, 7, ACTOR_SEEDS_START + 123):
        assert a.reset(seed)[0] == b.reset(seed)[0]
    other = ReasoningGym(dataset="leg_counting", seed=1)
    assert [a.reset(s)[0] for s in range(8)] != [other.reset(s)[0] for s in range(8)]


def test_prompt_holds_the_question_and_reasoning_gyms_instruction():
    from reasoning_gym.utils import SYSTEM_PROMPTS

    env = ReasoningGym(**SMALL, instruction="direct")
    observation, _ = env.reset(3)
    assert observation.startswith(env.tasks.held_out[3]["question"].strip())
    assert SYSTEM_PROMPTS["direct"] in observation and "calc:" not in observation


def test_reward_is_the_datasets_score_of_the_last_answer_tag():
    env = ReasoningGym(**SMALL)
    env.reset(5)
    right = answer_of(env)
    action = f"thinking <answer>0</answer> so <answer> {right} </answer>"
    _, reward, terminated, truncated, info = env.step(action)
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["success"] and info["answer"] == right
    env.reset(5)
    wrong = str(int(right) + 1)
    _, reward, _, _, info = env.step(f"<answer>{wrong}</answer>")
    assert reward == env.tasks.dataset.score_answer(wrong, env._item) and not info["success"]
    env.reset(5)
    _, reward, terminated, _, info = env.step(right)  # no tag: nothing extracted
    assert (reward, terminated, info["answer"]) == (0.0, True, None)


def test_format_reward_is_added_only_with_a_tag():
    env = ReasoningGym(**SMALL, format_reward=0.25)
    env.reset(1)
    assert env.step("<answer>nonsense</answer>")[1] == 0.25
    env.reset(1)
    assert env.step("nonsense")[1] == 0.0
    env.reset(1)
    assert env.step(f"<answer>{answer_of(env)}</answer>")[1] == 1.25


def test_last_number_fallback_only_without_a_tag():
    strict, lenient = ReasoningGym(**SMALL), ReasoningGym(**SMALL, fallback="last_number",
                                                          format_reward=0.1)
    for env in (strict, lenient):
        env.reset(4)
    right = answer_of(lenient)
    assert strict.step(f"3 + 4 = {right}")[1] == 0.0  # reasoning-gym's own rule: no tag, no answer
    _, reward, _, _, info = lenient.step(f"3 + 4 = {right}.")
    assert (reward, info["answer"], info["tagged"]) == (1.0, right, False)
    lenient.reset(4)
    _, reward, _, _, info = lenient.step(f"<answer>{int(right) + 1}</answer> or {right}")
    assert info["answer"] == str(int(right) + 1) and reward == 0.1  # the tag wins
    lenient.reset(4)
    assert lenient.step("no number here")[4]["answer"] is None


def test_partial_credit_scorer_is_used_as_is():
    env = ReasoningGym(dataset="spell_backward")
    env.reset(0)
    right = answer_of(env)
    close = right[:-1] + ("a" if right[-1] != "a" else "b")
    expected = env.tasks.dataset.score_answer(close, env._item)
    _, reward, _, _, info = env.step(f"<answer>{close}</answer>")
    assert reward == expected and info["score"] == expected and not info["success"]


def test_calculator_tool_multi_turn():
    env = ReasoningGym(**SMALL, tool=True, max_turns=3)
    observation, _ = env.reset(2)
    assert "calc:" in observation
    expr = env.tasks.held_out[2]["metadata"]["expression"] if "expression" in \
        env.tasks.held_out[2]["metadata"] else "1+1"
    obs, reward, terminated, truncated, info = env.step(f"calc: {expr}")
    assert obs.startswith("= ") and (reward, terminated, truncated) == (0.0, False, False)
    assert info["tool_calls"] == 1 and not info["tool_error"]
    obs, _, _, _, info = env.step("calc: 1/0")
    assert obs == "error: division by zero" and info["tool_error"]
    _, reward, terminated, _, info = env.step(f"<answer>{answer_of(env)}</answer>")
    assert (reward, terminated, info["tool_calls"]) == (1.0, True, 2)


def test_calculator_turns_run_out_truncates():
    env = ReasoningGym(**SMALL, tool=True, max_turns=2)
    env.reset(0)
    env.step("calc: 2+2")
    _, reward, terminated, truncated, _ = env.step("calc: 3+3")
    assert (reward, terminated, truncated) == (0.0, False, True)


def test_without_the_tool_a_calc_line_is_an_answer():
    env = ReasoningGym(**SMALL)
    env.reset(0)
    _, reward, terminated, _, _ = env.step("calc: 2+2")
    assert (reward, terminated) == (0.0, True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dataset="chainsum"),
     r"dataset='chainsum' is not a reasoning-gym dataset \(did you mean chain_sum"),
    (dict(dataset="chain_sum", min_term=2),
     r"min_term are not options of dataset 'chain_sum'; its options: allow_negation, max_digits"),
    (dict(dataset="chain_sum", min_terms=5, max_terms=2),
     r"dataset 'chain_sum' refuses .*max_terms must be >= min_terms"),
    (dict(dataset="chain_sum", size=10), "eval_size"),
    (dict(dataset="chain_sum", eval_size=0), "eval_size=0"),
    (dict(dataset="chain_sum", tool=True, max_turns=1), "max_turns=1"),
    (dict(dataset="chain_sum", format_reward=-1), "format_reward=-1"),
    (dict(dataset="chain_sum", instruction="terse"), "instruction='terse' is not one of .*direct"),
    (dict(dataset=3), "must be a dataset name"),
    (dict(dataset="chain_sum", fallback="first_number"), "fallback='first_number' must be one of"),
])
def test_bad_kwargs_get_one_clear_error(kwargs, message):
    with pytest.raises(EnvError, match=message):
        ReasoningGym(**kwargs)


def test_tiny_task_space_is_refused_not_looped():
    env = ReasoningGym(dataset="chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=1,
                       allow_negation=False, eval_size=1000)
    with pytest.raises(EnvError, match="task space is too small"):
        for seed in range(ACTOR_SEEDS_START, ACTOR_SEEDS_START + 200):
            env.reset(seed)


def test_registry_builds_it_and_reports_bad_kwargs():
    make = env_factory(EnvConfig(name="reasoning_gym", kwargs={"dataset": "leg_counting"}))
    env = make()
    assert isinstance(env, ReasoningGym) and env.spec.max_turns == 1
    with pytest.raises(EnvError, match="not a reasoning-gym dataset"):
        env_factory(EnvConfig(name="reasoning_gym", kwargs={"dataset": "nope"}))
    with pytest.raises(EnvError, match="do not fit reasoning_gym"):
        env_factory(EnvConfig(name="reasoning_gym", kwargs={}))


def test_env_imports_no_jax():
    import subprocess
    import sys

    code = ("import sys; import headrace.env.reasoning_gym as m; m.ReasoningGym(dataset='chain_sum')"
            "; assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
