"""Tool calls, history reuse, sessions and access through the real `openai` client and LangChain's
ChatOpenAI, against a gateway whose policy is scripted (the tool call must come out of the
template's syntax; a random model would not write one)."""

import json
import time

import httpx
import numpy as np
import openai
import pytest

pytestmark = pytest.mark.timeout(120)

CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*48"}}\n</tool_call>'


def session_client(served, **kwargs):
    session = served.run(served.gateway.open_session)
    return session, openai.OpenAI(base_url=served.gateway.session_url(session),
                                  api_key=kwargs.get("key", "unused"), max_retries=0)


def test_tool_call_parses_and_the_history_reuses_recorded_tokens(scripted):
    served = scripted([f"Let me compute. {CALL}", "<answer>1776</answer>"])
    session, c = session_client(served)
    messages = [{"role": "user", "content": "What is 37*48?"}]
    r = c.chat.completions.create(model="m", messages=messages, tools=[CALC])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"expression": "37*48"}
    assert choice.message.content == "Let me compute."
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "1776"}]
    r = c.chat.completions.create(model="m", messages=messages, tools=[CALC])
    assert r.choices[0].message.content == "<answer>1776</answer>" and not r.choices[0].message.tool_calls
    (segment,) = session.record.segments
    first, second = served.engine.calls
    sampled = segment.calls[0].sampled.tolist()
    # the second context continues the first and its sampled tokens verbatim (not re-tokenized)
    assert second[:len(first) + len(sampled)] == first + sampled
    text = served.gateway.tokenizer.decode_markup(second)
    assert "<tool_call>" in text and "1776" in text and '"calculator"' in text.split(CALL)[0]
    assert served.gateway.metrics.counters["gateway/tool_calls"] == 1


def test_langchain_chat_openai_runs_a_tool_episode(scripted):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    served = scripted([CALL, "<answer>1776</answer>"])
    session = served.run(served.gateway.open_session)
    llm = ChatOpenAI(base_url=served.gateway.session_url(session), api_key="unused",
                     model="headrace", max_retries=0).bind_tools([CALC])
    history = [HumanMessage("What is 37*48?")]
    ai = llm.invoke(history)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "calculator"
    assert ai.tool_calls[0]["args"] == {"expression": "37*48"}
    history += [ai, ToolMessage("1776", tool_call_id=ai.tool_calls[0]["id"])]
    final = llm.invoke(history)
    assert "1776" in final.content
    assert len(session.record.segments) == 1 and len(session.record.segments[0].calls) == 2
    reward = httpx.post(f"{served.url}/sessions/{session.id}/reward", json={"reward": 1.0})
    assert reward.status_code == 200 and reward.json()["reward"] == 1.0
    (result,) = session.results()
    calls = session.record.segments[0].calls
    tokens = result.builder.arrays()[0]
    assert np.array_equal(tokens, np.concatenate([calls[-1].prompt, calls[-1].sampled]))
    assert result.reward == 1.0 and result.status == "ok"


def test_strict_refuses_other_sampling_and_the_token_guards_every_route(scripted):
    served = scripted(["hi"], token="s3cret", strict=True)
    anonymous = openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        anonymous.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "invalid_api_key"
    assert httpx.post(f"{served.url}/sessions").status_code == 401
    assert httpx.get(f"{served.url}/health").status_code == 200
    c = openai.OpenAI(base_url=f"{served.url}/v1", api_key="s3cret", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                  temperature=0.3)
    assert info.value.body["code"] == "sampling_overridden"
    assert "temperature=0.3" in info.value.body["message"]
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                  temperature=1.0)  # the run's own value is fine
    assert r.choices[0].message.content == "hi"


def test_exposed_without_a_token_is_refused(task):
    from headrace.gateway.app import GatewayConfigError, Server
    from headrace.gateway.service import Gateway, Settings
    from headrace.metrics.core import Metrics
    from tests.gateway.helpers import ScriptedEngine

    gateway = Gateway(ScriptedEngine(task.tokenizer, []), task.tokenizer, Metrics(), Settings())
    with pytest.raises(GatewayConfigError, match="token_env"):
        Server(gateway, host="0.0.0.0")


def test_post_sessions_and_reward_by_answer_and_idle_timeout(scripted):
    # 3 s of idle: the calls below, each following the last, must not outlast it on a loaded
    # machine; the expiry is then waited for (30 s at most).
    served = scripted(["a", "b"], session_timeout_s=3.0)
    body = httpx.post(f"{served.url}/sessions", json={}).json()
    assert body["base_url"] == f"{served.url}/sessions/{body['id']}/v1"
    c = openai.OpenAI(base_url=body["base_url"], api_key="unused", max_retries=0)
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    bad = httpx.post(f"{served.url}/sessions/{body['id']}/reward", json={"answer": "5"})
    assert bad.status_code == 400 and "no task" in bad.json()["error"]["message"]
    deadline = time.monotonic() + 30
    session = served.gateway.sessions[body["id"]]
    while not session.ended.is_set() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session.ended.is_set() and session.status == "error"
    assert "timed out" in session.error
    assert served.gateway.metrics.counters["gateway/session_timeouts"] == 1
    with pytest.raises(openai.NotFoundError):  # an expired session takes no more calls
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    (result,) = session.results()
    assert result.status == "error"
