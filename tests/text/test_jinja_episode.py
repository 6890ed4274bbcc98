"""A real `run_episode` with a checkpoint tokenizer and its Jinja template: what the sampler saw
and produced is recorded exactly, and mismatched turns and tool calls are counted."""

from __future__ import annotations

import asyncio

import pytest

from headrace.actor.episode import run_episode
from headrace.actor.policy import BatchedPolicy
from headrace.config import TextConfig
from headrace.env.base import Env, EnvSpec
from headrace.metrics.core import Metrics
from headrace.text.template import make_tokenizer
from tests.text.checkpoints import QWEN_TEMPLATE, TOOLS, qwen_style_folder
from tests.text.test_template import RecordingSampler, assert_recorded_exactly, scripted

pytest.importorskip("transformers")


class Echo(Env):
    """Answers every action with `result N`; ends after three turns."""

    spec = EnvSpec(vocabulary=None, max_turns=5)
    blocking = False

    def reset(self, seed):
        self.turn = 0
        return "Use the tools.", {}

    def step(self, action):
        self.turn += 1
        return f"result {self.turn}", 0.0, self.turn >= 3, False, {}


@pytest.mark.timeout(120)
def test_episode_counts_mismatches_and_tool_calls(tmp_path):
    folder = qwen_style_folder(tmp_path / "qwen")
    tokenizer = make_tokenizer(None, TextConfig(template=str(QWEN_TEMPLATE), tools=str(TOOLS),
                                                observation_role="tool"), init_from=f"hf:{folder}")
    eot = tokenizer.end_of_turn_id
    good = [*tokenizer.encode_markup('<tool_call>\n{"name": "calc", "arguments": {"expr": "1"}}'
                                     '\n</tool_call>'), eot]
    # non-canonical: one token per character, and a malformed call
    odd = [int(tokenizer.encode(c)[0]) for c in "<tool_call>{\"name\": 1}</tool_call>"]
    last = [*tokenizer.encode("Done."), eot]
    sampler = RecordingSampler(scripted([good, odd, last]))
    metrics = Metrics()

    async def main():
        policy = BatchedPolicy(sampler, metrics, max_batch=4, wait_s=0.0)
        server = asyncio.create_task(policy.serve())
        try:
            return await run_episode(Echo(), 0, policy, tokenizer, metrics, step_timeout_s=5.0)
        finally:
            server.cancel()
            policy.close()

    result = asyncio.run(main())
    assert result.status == "ok", result.error
    assert len(sampler.calls) == 3
    assert_recorded_exactly(result, sampler.calls)
    counters = metrics.counters
    assert counters["text/render_mismatch"] == 1  # the turn after the non-canonical one
    assert counters["text/tool_calls"] == 1 and counters["text/tool_call_errors"] == 1
    text = tokenizer.decode_markup(result.builder.tokens)
    assert "<tool_response>\nresult 1\n</tool_response>" in text and '"name": "calc"' in text
