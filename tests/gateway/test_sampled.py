"""The gateway on the real sampler through the real `openai` client: exact tokens per session,
behaviour log-probs as sampled, cuts at max_tokens / stop on token boundaries, branches for n > 1,
OpenAI-shaped errors."""

import numpy as np
import openai
import pytest

pytestmark = pytest.mark.timeout(300)


def client(url):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def open_session(sampled):
    session = sampled.run(sampled.gateway.open_session)
    return session, client(sampled.gateway.session_url(session))


def prefix_chain(calls):
    """Every call's prompt + sampled tokens is a prefix of the next call's prompt."""
    for a, b in zip(calls, calls[1:]):
        done = np.concatenate([a.prompt, a.sampled])
        assert np.array_equal(b.prompt[:len(done)], done)


def test_multi_turn_session_records_exactly_the_sampled_tokens(sampled):
    session, c = open_session(sampled)
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What is 2 + 3?"}]
    replies = []
    for turn in range(3):
        r = c.chat.completions.create(model="m", messages=messages, logprobs=True,
                                      extra_body={"return_token_ids": True})
        replies.append(r)
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": f"and then {turn}?"}]
    segments = session.record.segments
    assert len(segments) == 1 and len(segments[0].calls) == 3  # the history matched every time
    calls = segments[0].calls
    prefix_chain(calls)
    tokens, mask, logps, versions = segments[0].renderer.builder.arrays()
    last = calls[-1]
    assert np.array_equal(tokens, np.concatenate([last.prompt, last.sampled]))
    for r, call in zip(replies, calls):  # what the client was told is what was recorded
        extra = r.model_extra["headrace"]
        assert extra["prompt_token_ids"] == call.prompt.tolist()
        assert extra["token_ids"] == [call.sampled.tolist()]
        assert extra["policy_version"] == 0 == call.version
        wire = [t.logprob for t in r.choices[0].logprobs.content]
        np.testing.assert_allclose(wire, call.logprobs, rtol=0, atol=1e-6)
    # the loss mask marks exactly the sampled tokens, with their log-probs and version
    starts = [len(c.prompt) for c in calls]
    expected = np.zeros(len(tokens), bool)
    for s, call in zip(starts, calls):
        expected[s:s + len(call.sampled)] = True
    assert np.array_equal(mask, expected)
    np.testing.assert_array_equal(logps[mask], np.concatenate([c.logprobs for c in calls]))
    assert (versions[mask] == 0).all() and (versions[~mask] == -1).all()
    assert (logps[mask] < 0).all()


def test_edited_history_starts_a_new_segment(sampled):
    session, c = open_session(sampled)
    messages = [{"role": "user", "content": "Name a colour."}]
    r = c.chat.completions.create(model="m", messages=messages)
    reply = r.choices[0].message.model_dump(exclude_none=True)
    edited = [messages[0], {**reply, "content": (reply.get("content") or "") + " (edited)"},
              {"role": "user", "content": "Another?"}]
    c.chat.completions.create(model="m", messages=edited)
    record = session.record
    assert len(record.segments) == 2 and record.new_segments == 1
    second = record.segments[1]
    tokens, mask, _, _ = second.renderer.builder.arrays()
    call = second.calls[-1]
    assert np.array_equal(tokens, np.concatenate([call.prompt, call.sampled]))
    assert mask.sum() == len(call.sampled)  # the agent's edited assistant turn is prompt
    sampled.run(lambda: sampled.gateway.end(session, 1.0))
    results = session.results()
    assert [r.reward for r in results] == [1.0, 1.0]
    assert sampled.gateway.metrics.counters["gateway/new_segments"] >= 1


def test_max_tokens_and_stop_cut_on_token_boundaries(sampled):
    session, c = open_session(sampled)
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Count."}],
                                  max_tokens=3, extra_body={"return_token_ids": True})
    assert r.usage.completion_tokens <= 3
    call = session.record.segments[0].calls[0]
    assert len(call.sampled) <= 3 and r.model_extra["headrace"]["token_ids"] == [
        call.sampled.tolist()]
    # a stop string: the first sampled character of a fresh reply always stops it
    session, c = open_session(sampled)
    probe = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Go."}],
                                      max_tokens=1)
    text = probe.choices[0].message.content or ""
    if text.strip():
        stop = text.strip()[0]
        r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Go!"}],
                                      stop=[stop])
        assert stop not in (r.choices[0].message.content or "")
        last = session.record.segments[-1].calls[-1]
        decoded = sampled.gateway.tokenizer.decode(last.sampled)
        assert stop in decoded or r.choices[0].finish_reason != "stop"


def test_n_choices_become_branches(sampled):
    session, c = open_session(sampled)
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    record = session.record
    assert len(record.segments) == 3 and record.branches == 2
    for segment in record.segments:
        call = segment.calls[-1]
        tokens = segment.renderer.builder.arrays()[0]
        assert np.array_equal(tokens, np.concatenate([call.prompt, call.sampled]))
    # the agent continues the second choice: that branch is extended, nothing new starts
    messages = [{"role": "user", "content": "Hi"},
                r.choices[1].message.model_dump(exclude_none=True),
                {"role": "user", "content": "More"}]
    c.chat.completions.create(model="m", messages=messages)
    assert len(record.segments) == 3 and len(record.segments[1].calls) == 2
    prefix_chain(record.segments[1].calls)


def test_errors_are_openai_shaped(sampled):
    gateway = sampled.gateway
    bad = client(f"{sampled.url}/sessions/no-such-session/v1")
    with pytest.raises(openai.NotFoundError) as info:
        bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "session_not_found"
    c = client(f"{sampled.url}/v1")
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])
    assert info.value.body["param"].startswith("messages") and info.value.body["type"]
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x " * 3000}])
    assert info.value.body["code"] == "context_length_exceeded"
    assert gateway.metrics.counters["gateway/too_long"] >= 1
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                  top_logprobs=3)
    assert info.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                  tools=[{"type": "custom", "custom": {"name": "grep"}}])
    assert info.value.body["param"] == "tools" and "custom" in info.value.body["message"]
    assert [m.id for m in c.models.list()] == ["headrace"]
    # other sampling parameters: served at the run's and counted
    before = gateway.metrics.counters["gateway/overridden_sampling"]
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                              temperature=0.2, top_p=0.5)
    assert gateway.metrics.counters["gateway/overridden_sampling"] == before + 2


def test_streamed_top_logprobs_come_from_the_sampled_distribution(sampled):
    """Streamed: the record is what the chunks say; each token's alternatives are the k
    likeliest of the distribution its own log-prob is of (values against the float64 reference:
    tests/model/test_sampler_top.py)."""
    session, c = open_session(sampled)
    before = sampled.gateway.metrics.counters.get("gateway/overridden_sampling", 0)
    chunks = list(c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say a word."}], stream=True,
        logprobs=True, top_logprobs=5, stream_options={"include_usage": True},
        extra_body={"return_token_ids": True}))
    (call,) = session.record.segments[0].calls
    assert chunks[-1].model_extra["headrace"]["token_ids"] == [call.sampled.tolist()]
    assert chunks[-1].usage.completion_tokens == len(call.sampled)
    entries = [e for ch in chunks for choice in ch.choices if choice.logprobs
               for e in choice.logprobs.content]
    assert len(entries) == len(call.sampled)
    np.testing.assert_allclose([e.logprob for e in entries], call.logprobs, rtol=0, atol=1e-6)
    for entry in entries:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert values[0] >= entry.logprob - 1e-6 and np.exp(values).sum() <= 1 + 1e-5
        if entry.logprob > values[-1] + 1e-5:  # likelier than the 5th: it is among them
            assert entry.token in [t.token for t in entry.top_logprobs]
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi."}],
                                  logprobs=True, top_logprobs=20)
    assert all(len(e.top_logprobs) == 20 for e in r.choices[0].logprobs.content)
    assert sampled.gateway.metrics.counters.get("gateway/overridden_sampling", 0) == before
