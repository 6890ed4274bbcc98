"""The OpenAI chat wire format the gateway speaks: request models (pydantic) and response bodies.

Requests are validated by pydantic; a malformed one is answered with an OpenAI-shaped 4xx body
(`error_body`): `{"error": {"message", "type", "param", "code"}}`, which the `openai` client turns
into its `BadRequestError` / `NotFoundError` / `AuthenticationError`. Fields the gateway does not
read are accepted and ignored (`extra="allow"`: clients send `user`, `seed`, `metadata`, ...),
except the sampling ones it must serve as configured (`headrace.gateway.app`).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str = ""
    type: str = "function"
    function: FunctionCall


class Message(BaseModel):
    """One chat message; `content` may be a string, a list of text parts, or null."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None  # a last chunk with the usage (every chunk has usage: null)


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = ""
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float | None = None  # the episode's return, or
    answer: str | None = None  # the final answer, scored by the session's task


class SessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: str | None = None  # reserved: sessions are handed out in the runner's task order


class GatewayError(Exception):
    """An OpenAI-shaped error response: HTTP `status` and `body`."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = error_body(message, kind, param, code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """An OpenAI-shaped error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def completion_body(request_id: str, model: str, choices: list[dict[str, Any]],
                    prompt_tokens: int, completion_tokens: int,
                    extra: dict[str, Any]) -> dict[str, Any]:
    """A `chat.completion` object; `extra` (the exact tokens) rides under `headrace`, a key the
    OpenAI clients keep on the response object and otherwise ignore."""
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices, "system_fingerprint": None,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "headrace": extra}


def text_of(content: str | list[dict[str, Any]] | None) -> str:
    """A message's text: a string as is, the text parts of a list joined, null as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")
