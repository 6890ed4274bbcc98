"""An agent written only against the OpenAI API, trained by headrace through its gateway.

It answers an arithmetic question in up to three chat calls, with a calculator tool it may call
first (the standard OpenAI `tools` / `tool_calls` / `role: tool` loop), and returns the reward
the task gives its final answer. Nothing in it is headrace's: point `base_url` at any OpenAI
endpoint and it runs the same (`task` is any object with `prompt` and `score(answer)`).

    headrace train examples/gateway_reasoning.yaml   # env.kwargs.agent names run_episode
"""

from __future__ import annotations

import ast
import json
import operator

from openai import AsyncOpenAI

MAX_CALLS = 3
CALCULATOR = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluates an arithmetic expression of integers with + - * / // % ** ( ).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or an error line (never raises)."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    try:
        return str(value(ast.parse(str(expression), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as error:
        return f"error: {error}"


async def run_episode(base_url: str, task, seed: int) -> float:
    """One episode: the question, tool calls answered by `calculate`, the scored final answer."""
    client = AsyncOpenAI(base_url=base_url, api_key="headrace", max_retries=0, timeout=600)
    messages = [{"role": "user", "content": task.prompt}]
    answer = ""
    try:
        for _ in range(MAX_CALLS):
            response = await client.chat.completions.create(
                model="headrace", messages=messages, tools=[CALCULATOR])
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))  # the turn, sent back as is
            answer = message.content or ""
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                try:
                    expression = json.loads(call.function.arguments).get("expression", "")
                except (ValueError, AttributeError):
                    expression = call.function.arguments
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": calculate(expression)})
    finally:
        await client.close()
    return task.score(answer)
