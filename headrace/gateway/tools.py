"""Tools over the wire: checking a request's tool schemas, and tool calls parsed from sampled text.

The chat template writes tools one of two ways (`headrace.text.jinja_template`): its own syntax
when it reads `tools` (Qwen2.5, Hermes, Llama 3.1), else the hermes fallback block in the system
message. Both call a tool with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, which
`headrace.text.tools.parse_tool_calls` reads. A schema either cannot express is refused with a
400 naming the tool (`ToolSchemaError`): a type other than `function`, a missing or malformed
name, parameters that are not a JSON object.

A response's message carries the calls as OpenAI `tool_calls` (arguments as a JSON string, an id
per call) and the text around them as `content`; a malformed call stays in the content, counted
(`gateway/tool_call_errors`).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from headrace.text.tools import ToolCall, parse_tool_calls

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
CALL_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


class ToolSchemaError(ValueError):
    """A tool schema the chat template cannot express; the message names the tool."""


def check_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's tools in the shape templates read (`{"type": "function", "function":
    {name, description, parameters}}`).

    Raises:
      ToolSchemaError: see the module docstring.
    """
    out = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            raise ToolSchemaError(f"{where}: type {tool.get('type')!r} cannot be expressed by the "
                                  "chat template; only function tools are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolSchemaError(f"{where}: a function tool needs a `function` object")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolSchemaError(f"{where}.function.name={name!r}: 1-64 letters, digits, _ or -")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolSchemaError(f"{where}.function.parameters: must be a JSON Schema object")
        try:
            json.dumps(parameters)
        except (TypeError, ValueError) as error:
            raise ToolSchemaError(f"{where}.function.parameters: not JSON ({error})") from None
        entry = {"name": name, "parameters": parameters}
        if function.get("description"):
            entry["description"] = str(function["description"])
        out.append({"type": "function", "function": entry})
    return out


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def wire_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Parsed calls as an OpenAI message's `tool_calls` (ids fresh, arguments as JSON text)."""
    return [{"id": call_id(), "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments,
                                                                  ensure_ascii=False)}}
            for c in calls]


def split_calls(text: str) -> tuple[str | None, list[dict[str, Any]], list[str]]:
    """(content without the well-formed call blocks, or None when nothing is left; the calls in
    wire form; an error per malformed call). With a malformed call the text stays whole."""
    calls, errors = parse_tool_calls(text)
    if not calls:
        return text, [], errors
    content = text if errors else CALL_BLOCK.sub("", text).strip()
    return content or None, wire_calls(calls), errors
