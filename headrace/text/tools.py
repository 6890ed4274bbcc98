"""Tool calls parsed from generated text (JAX-free).

Both formats headrace renders write a call as a JSON object inside `<tool_call>` tags: the hermes
fallback (`text.tool_format: hermes`) and the templates with that syntax (Qwen2.5, Qwen3, Hermes):

    <tool_call>
    {"name": "calc", "arguments": {"expr": "2+3"}}
    </tool_call>

`parse_tool_calls(text)` returns every well-formed call as `ToolCall(name, arguments)` and one
readable error per malformed one (bad JSON, no name, arguments not an object, an unclosed tag), so
an actor counts them (`text/tool_calls`, `text/tool_call_errors`) and the episode goes on.
`arguments` may also be given as a JSON string holding the object (OpenAI's wire form), and
`parameters` is read as a synonym (Llama 3.1's JSON tool calls).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def message(self) -> dict[str, Any]:
        """As an assistant message's `tool_calls` entry (what chat templates read)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _one(body: str) -> ToolCall | str:
    try:
        obj = json.loads(body)
    except ValueError as error:
        return f"not JSON ({error.args[0]}): {body.strip()[:80]!r}"
    if not isinstance(obj, dict):
        return f"not a JSON object: {body.strip()[:80]!r}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"no \"name\" string in {body.strip()[:80]!r}"
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return f"{name}: \"arguments\" is a string that is not JSON: {arguments[:60]!r}"
    if not isinstance(arguments, dict):
        return f"{name}: \"arguments\" must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """(the well-formed calls in order, an error message per malformed one); never raises."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for match in _CALL.finditer(text):
        if not match[2]:
            errors.append(f"<tool_call> without </tool_call>: {match[1].strip()[:80]!r}")
            continue
        parsed = _one(match[1])
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)
    return calls, errors
