"""tool_calculator: the safe evaluator, the episode rules, the no-tool baseline, the registry."""

from __future__ import annotations

import pytest

from headrace.config import EnvConfig
from headrace.env.base import EnvError
from headrace.env.registry import env_factory
from headrace.env.tool_calculator import CalcError, ToolCalculator, evaluate, parse_action


@pytest.mark.parametrize("expr, value", [
    ("37*48", "1776"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("-7+2", "-5"), ("7//2", "3"),
    ("7%3", "1"), ("8/2", "4"), ("7/2", "3.5"), ("2**10", "1024"), (" 12 - 30 ", "-18"),
])
def test_evaluate_matches_python(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr, message", [
    ("", "empty"), ("2+", "cannot parse"), ("__import__('os').system('id')", "unsupported"),
    ("x*2", "unsupported"), ("1.5*2", "unsupported"), ("1/0", "division by zero"),
    ("9**9**9", "exponent"), ("99999**40", "too large"), ("1" * 81, "longer than"),
    ("10**17*100", "too large"), ("'a'*3", "unsupported"), ("True+1", "unsupported"),
])
def test_evaluate_rejects_with_a_reason(expr, message):
    with pytest.raises(CalcError, match=message):
        evaluate(expr)


def test_parse_action():
    assert parse_action("calc: 2+2") == ("calc", "2+2")
    assert parse_action("  CALC:2*3 ") == ("calc", "2*3")
    assert parse_action("answer: 42") == ("answer", "42")
    assert parse_action("the answer is 42") is None
    assert parse_action("search: cats") is None


def test_same_seed_same_question_and_difficulty():
    env = ToolCalculator(digits=3, terms=3)
    assert env.reset(7) == env.reset(7)
    questions = {env.reset(seed)[0] for seed in range(50)}
    assert len(questions) > 45
    expr, _ = env.question_for(11)
    numbers = expr.replace("+", " ").replace("-", " ").replace("*", " ").split()
    assert len(numbers) == 3 and all(len(n) == 3 for n in numbers)


def test_solve_wins_every_seed_with_and_without_the_tool():
    for tool_enabled in (True, False):
        env = ToolCalculator(tool_enabled=tool_enabled)
        for seed in range(100):
            env.reset(seed)
            actions = env.solve(seed)
            assert len(actions) == (2 if tool_enabled else 1)
            for action in actions:
                obs, reward, terminated, truncated, info = env.step(action)
            assert (obs, reward, terminated, info["success"]) == ("correct", 1.0, True, True)


def test_tool_call_malformed_call_and_disabled_tool():
    env = ToolCalculator(max_turns=4)
    env.reset(0)
    assert env.step("calc: 6*7")[0] == "= 42"
    obs, reward, terminated, truncated, info = env.step("calc: 6*")
    assert obs.startswith("error: ") and info["tool_error"] and not terminated and reward == 0
    assert info["tool_calls"] == 2
    disabled = ToolCalculator(tool_enabled=False)
    disabled.reset(0)
    obs, _, terminated, _, info = disabled.step("calc: 6*7")
    assert obs == "tool disabled" and not terminated and not info["tool_error"]


def test_wrong_answer_invalid_actions_and_turn_limit():
    env = ToolCalculator(max_turns=2)
    env.reset(0)
    _, answer = env.question_for(0)
    assert env.step(f"answer: {int(answer) + 1}")[1:4] == (0.0, True, False)
    for bad in ("hello", "answer: forty-two", "answer:", ""):
        env.reset(0)
        obs, reward, terminated, truncated, info = env.step(bad)
        assert (reward, terminated, info["invalid_action"]) == (0.0, True, True)
    env.reset(0)
    assert env.step("calc: 1+1")[3] is False
    obs, reward, terminated, truncated, info = env.step("calc: 1+1")
    assert truncated and not terminated and reward == 0.0
    env.reset(0)
    assert env.step(f"answer: {int(answer):,}")[1] == 1.0  # thousands separators are accepted


def test_bad_arguments_and_registry():
    for kwargs in ({"digits": 0}, {"terms": 1}, {"ops": "/"}, {"max_turns": 0}):
        with pytest.raises(EnvError, match="tool_calculator"):
            ToolCalculator(**kwargs)
    make = env_factory(EnvConfig(name="tool_calculator", kwargs={"digits": 1}))
    env = make()
    assert isinstance(env, ToolCalculator) and env.digits == 1 and not env.blocking
    assert env.spec.vocabulary is None and env.spec.max_turns == 3
    with pytest.raises(EnvError, match="do not fit"):
        env_factory(EnvConfig(name="tool_calculator", kwargs={"bogus": 1}))
