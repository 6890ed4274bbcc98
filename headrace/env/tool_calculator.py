"""tool_calculator: arithmetic a small policy answers reliably only by calling a calculator tool.

The first observation is a question such as `What is 37*48?`. Each action is one line:

- `calc: EXPR` calls the tool; the observation is `= VALUE` (e.g. `= 1776`), or `error: WHY` for a
  malformed expression (the episode goes on), or `tool disabled` when built with
  `tool_enabled=False` (the no-tool baseline);
- `answer: N` ends the episode: reward 1 when N is the right integer, else 0.

Anything else (no known command, or an answer that is not an integer) is an invalid action: the
episode ends with reward 0 and `info["invalid_action"] = True`. After `max_turns` actions without an
answer the episode is truncated with reward 0. The tool evaluates integers with + - * / // % ** and
parentheses (via `ast`, never `eval`), at most `MAX_EXPR_CHARS` characters and results below
`MAX_MAGNITUDE`; an inexact division gives a decimal.

Info keys: success, tool_calls (so far), tool_error (this step's call failed), invalid_action.
The prompt is `What is EXPR?`: `terms` operands of `digits` digits joined by operators from `ops`.
"""

from __future__ import annotations

import ast
import fractions
import random
from typing import Any

from headrace.env.base import Env, EnvError, EnvSpec, StepResult

MAX_EXPR_CHARS = 80
MAX_MAGNITUDE = 10**18
TOOL_DISABLED = "tool disabled"
_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b,
           ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}


class CalcError(ValueError):
    """A malformed or out-of-range expression; the message is shown to the policy."""


def evaluate(expr: str) -> str:
    """The value of an integer arithmetic expression as text (an integer, or a decimal).

    Raises:
      CalcError: not arithmetic, too long, division by zero, or a value too large.
    """
    text = expr.strip()
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalcError(f"cannot parse {text!r}") from None
    value = _eval(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6g}"


def _eval(node: ast.AST) -> fractions.Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = fractions.Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _eval(node.operand)
        value = -operand if isinstance(node.op, ast.USub) else operand
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exponent = _eval(node.left), _eval(node.right)
        if exponent.denominator != 1 or not 0 <= exponent <= 64:
            raise CalcError("exponent must be an integer in 0..64")
        if abs(base) > 1 and exponent * len(str(abs(base.numerator))) > 19:
            raise CalcError("value too large")
        value = base ** int(exponent)
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if right == 0 and isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod):
            raise CalcError("division by zero")
        value = fractions.Fraction(_BINARY[type(node.op)](left, right))
    else:
        raise CalcError(f"unsupported syntax {type(node).__name__}: use integers and + - * / ( )")
    if abs(value) >= MAX_MAGNITUDE:
        raise CalcError("value too large")
    return value


def parse_action(action: str) -> tuple[str, str] | None:
    """("calc", expression) or ("answer", text) for a well-formed command, else None."""
    command, sep, argument = action.strip().partition(":")
    command = command.strip().lower()
    if not sep or command not in ("calc", "answer"):
        return None
    return command, argument.strip()


class ToolCalculator(Env):
    """Arithmetic questions with a calculator tool (see the module docstring).

    Args:
      digits: digits per operand (difficulty).
      terms: operands per question.
      ops: the operators questions use, a subset of "+-*".
      max_turns: actions per episode.
      tool_enabled: False answers every call with "tool disabled" (the no-tool baseline).

    Raises:
      EnvError: an argument out of range.
    """

    blocking = False  # pure computation, microseconds
    env_name = "tool_calculator"  # in error messages

    def __init__(self, digits: int = 2, terms: int = 2, ops: str = "+-*", max_turns: int = 3,
                 tool_enabled: bool = True):
        if not 1 <= digits <= 6:
            raise EnvError(f"{self.env_name}: digits={digits} must be in 1..6")
        if not 2 <= terms <= 4:
            raise EnvError(f"{self.env_name}: terms={terms} must be in 2..4")
        if not ops or set(ops) - set("+-*"):
            raise EnvError(f"{self.env_name}: ops={ops!r} must be a non-empty subset of '+-*'")
        if max_turns < 1:
            raise EnvError(f"{self.env_name}: max_turns={max_turns} must be >= 1")
        self.digits, self.terms, self.ops = digits, terms, ops
        self.max_turns, self.tool_enabled = max_turns, tool_enabled
        self.spec = EnvSpec(vocabulary=None, action_words=None, max_turns=max_turns)
        self._answer = ""
        self._turns = 0
        self._tool_calls = 0

    def question_for(self, seed: int) -> tuple[str, str]:
        """(expression, its value) of task `seed`."""
        rng = random.Random(seed)
        low, high = 10 ** (self.digits - 1) if self.digits > 1 else 0, 10**self.digits - 1
        expr = str(rng.randint(low, high))
        for _ in range(self.terms - 1):
            expr += rng.choice(self.ops) + str(rng.randint(low, high))
        return expr, evaluate(expr)

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        expr, self._answer = self.question_for(seed)
        self._turns = self._tool_calls = 0
        return f"What is {expr}?", {}

    def solve(self, seed: int) -> list[str]:
        """A correct demonstration: call the tool on the question, then answer its value."""
        expr, answer = self.question_for(seed)
        return ([f"calc: {expr}"] if self.tool_enabled else []) + [f"answer: {answer}"]

    def step(self, action: str) -> StepResult:
        parsed = self._begin(action)
        if not isinstance(parsed, str):
            return parsed
        if not self.tool_enabled:
            return self._tool_result(TOOL_DISABLED, tool_error=False)
        try:
            return self._tool_result(f"= {evaluate(parsed)}", tool_error=False)
        except CalcError as error:
            return self._tool_result(f"error: {error}", tool_error=True)

    def _begin(self, action: str) -> StepResult | str:
        """Counts the turn; answers and invalid actions end here; a tool call returns its expr."""
        self._turns += 1
        parsed = parse_action(action)
        if parsed is None:
            return self._invalid()
        command, argument = parsed
        if command == "answer":
            text = argument.replace(",", "")
            if not text.lstrip("-").isdigit():
                return self._invalid()
            success = int(text) == int(self._answer)
            return ("correct" if success else "wrong"), float(success), True, False, {
                "success": success, "tool_calls": self._tool_calls, "tool_error": False}
        self._tool_calls += 1
        return argument

    def _tool_result(self, observation: str, tool_error: bool,
                     extra: dict[str, Any] | None = None) -> StepResult:
        truncated = self._turns >= self.max_turns
        info = {"success": False, "tool_calls": self._tool_calls, "tool_error": tool_error,
                **(extra or {})}
        return observation, 0.0, False, truncated, info

    def _invalid(self) -> StepResult:
        return "", 0.0, True, False, {"invalid_action": True, "success": False,
                                      "tool_calls": self._tool_calls, "tool_error": False}
