"""Chat templates: the recorded episode is exactly what the sampler saw and produced.

The central test drives the real `run_episode` and `BatchedPolicy` with a recording sampler (no
model): every context it was given must be a prefix of the recorded tokens, its tokens must follow
at once with loss mask 1 and its log-probs, and nothing else may carry loss mask 1.
"""

import asyncio

import numpy as np
import pytest

from headrace.actor.actor import to_trajectory
from headrace.actor.episode import run_episode
from headrace.actor.policy import BatchedPolicy
from headrace.config import ConfigError, TextConfig
from headrace.env.base import Env, EnvSpec
from headrace.env.guess_number import GuessNumber
from headrace.env.tool_calculator import ToolCalculator
from headrace.metrics.core import Metrics
from headrace.text.template import (
    CHAT,
    PLAIN,
    ROLE_TOKENS,
    EpisodeRenderer,
    make_tokenizer,
    resolve,
)
from headrace.text.tokenizers import BOS, EOS, ByteTokenizer, TokenizerError, WordTokenizer


class RecordingSampler:
    """Stands in for `Sampler`: answers each context from a script, records what it saw."""

    episodes = 0  # keeps no cache between turns
    compiles = inline_compiles = 0

    def __init__(self, script, max_context=4096, version=3):
        self.script = script  # context -> list of token ids to "generate"
        self.version = version
        self._max_context = max_context
        self.calls: list[tuple[list[int], np.ndarray, np.ndarray]] = []
        self._rng = np.random.default_rng(0)

    def max_context(self):
        return self._max_context

    def generate(self, contexts, greedy=False, slots=None):
        tokens, logps = [], []
        for context in contexts:
            out = np.asarray(self.script(list(context)), np.int32)
            lp = -self._rng.uniform(0.01, 3.0, len(out)).astype(np.float32)
            self.calls.append((list(context), out, lp))  # a copy: the context list grows later
            tokens.append(out)
            logps.append(lp)
        return tokens, logps, self.version

    def close(self):
        pass


def play(env, seed, sampler, tokenizer):
    async def main():
        policy = BatchedPolicy(sampler, Metrics(), max_batch=8, wait_s=0.0)
        server = asyncio.create_task(policy.serve())
        try:
            return await run_episode(env, seed, policy, tokenizer, Metrics(), step_timeout_s=5.0)
        finally:
            server.cancel()
            policy.close()

    return asyncio.run(main())


def assert_recorded_exactly(result, calls):
    tokens, mask, logps, versions = result.builder.arrays()
    generated = np.zeros(len(tokens), bool)
    for context, out, lp in calls:
        n = len(context)
        assert tokens[:n].tolist() == context, "a context is not a prefix of the trajectory"
        assert tokens[n:n + len(out)].tolist() == out.tolist(), "generated tokens were changed"
        assert mask[n:n + len(out)].all()
        np.testing.assert_array_equal(logps[n:n + len(out)], lp)
        assert (versions[n:n + len(out)] == 3).all()
        generated[n:n + len(out)] = True
    assert (mask == generated).all(), "loss mask 1 outside the generated tokens"
    assert (logps[~mask] == 0).all() and (versions[~mask] == -1).all()


def scripted(actions):
    """Answers the k-th policy call with actions[k] (the last one from then on)."""
    calls = iter(range(1 << 30))
    return lambda context: actions[min(next(calls), len(actions) - 1)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("template", ["plain", "chat"])
def test_tool_episode_records_what_the_sampler_saw_and_produced(template):
    tokenizer = make_tokenizer(None, TextConfig(template=template, system="You add.",
                                                observation_role="tool"))
    env = ToolCalculator(digits=1, terms=2, ops="+", max_turns=3)
    expr, value = env.question_for(5)
    calc = [*tokenizer.encode(f"calc: {expr}"), EOS]  # ends with <eos>
    answer = list(tokenizer.encode(f"answer: {value}"))  # hit max_new_tokens: no <eos>
    sampler = RecordingSampler(scripted([calc, answer]))
    result = play(env, 5, sampler, tokenizer)
    assert result.status == "ok" and result.reward == 1.0 and result.success
    assert len(sampler.calls) == 2
    assert_recorded_exactly(result, sampler.calls)
    trajectory = to_trajectory(result, trajectory_id="t", group_id="g", task_id="x",
                               env_name="tool_calculator", actor_id="a", sampling={})
    trajectory.validate()
    roles = [t.role for t in trajectory.turns]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert trajectory.turns[-1].reward == 1.0
    # Turns tile the trajectory, in order.
    assert trajectory.turns[0].start == 0 and trajectory.turns[-1].end == len(trajectory)
    for a, b in zip(trajectory.turns, trajectory.turns[1:]):
        assert a.end == b.start


@pytest.mark.timeout(60)
def test_plain_template_is_the_historical_rendering():
    """The default must not change guess_number's (or any env's) token sequences."""
    env = GuessNumber(n=8, max_turns=3)
    tokenizer = make_tokenizer(env.spec.vocabulary)
    assert tokenizer.vocab_size == WordTokenizer(env.spec.vocabulary).vocab_size
    guesses = [tokenizer.ids_of(["4"]), tokenizer.ids_of(["6"]), tokenizer.ids_of(["7"])]
    sampler = RecordingSampler(lambda ctx: list(guesses[(len(ctx) - 2) // 2]))
    seed = next(s for s in range(100) if env.secret_for(s) not in (4, 6, 7))
    result = play(env, seed, sampler, tokenizer)
    assert_recorded_exactly(result, sampler.calls)
    # The old builder: [BOS, obs], then action, observation, action, ... with no markers.
    env.reset(seed)
    expected = [BOS, *tokenizer.encode("start")]
    for guess in guesses:
        expected += list(guess)
        obs, _, terminated, truncated, _ = env.step(tokenizer.decode(guess))
        if terminated or truncated:
            break
        expected += list(tokenizer.encode(obs))
    assert result.builder.tokens == expected
    assert [t.role for t in result.builder.turns] == ["user", "assistant", "user", "assistant",
                                                      "user", "assistant"]


def test_chat_template_layout_and_closing_eos():
    tokenizer = make_tokenizer(None, TextConfig(template="chat", observation_role="tool"))
    ids = {role: tokenizer.special_id(tok) for role, tok in ROLE_TOKENS.items()}
    r = EpisodeRenderer(tokenizer)
    r.add_observation("hi", first=True)
    context = list(r.prompt())
    assert context == [BOS, ids["user"], *tokenizer.encode("hi"), EOS, ids["assistant"]]
    assert r.prompt() == context  # idempotent: one header only
    r.add_generated([70, 71], [-1.0, -2.0], 0)  # no <eos>: the template closes the turn
    r.add_observation("= 3")
    r.prompt()
    r.add_generated([72, EOS], [-1.0, -1.0], 1)  # closed by the sampler: nothing added
    r.add_observation("ok", role="user")
    tokens, mask, _, _ = r.builder.arrays()
    expected = context + [70, 71, EOS, ids["tool"], *tokenizer.encode("= 3"), EOS,
                          ids["assistant"], 72, EOS, ids["user"], *tokenizer.encode("ok"), EOS]
    assert tokens.tolist() == expected
    assert [i for i, m in enumerate(mask) if m] == [len(context), len(context) + 1,
                                                    len(context) + 9, len(context) + 10]
    assert [t.role for t in r.builder.turns] == ["user", "assistant", "tool", "assistant", "user"]


def test_generated_turn_needs_its_header_under_chat():
    r = EpisodeRenderer(make_tokenizer(None, TextConfig(template="chat")))
    r.add_observation("hi", first=True)
    with pytest.raises(ValueError, match="before prompt"):
        r.add_generated([70], [-1.0], 0)


def test_special_tokens_extend_the_vocabulary_and_cannot_be_forged():
    plain, chat = ByteTokenizer(), make_tokenizer(None, TextConfig(template="chat"))
    assert chat.vocab_size == plain.vocab_size + len(ROLE_TOKENS)
    assert chat.encode("<|user|> a").tolist() == plain.encode("<|user|> a").tolist()
    user = chat.special_id("<|user|>")
    assert user >= plain.vocab_size
    assert chat.decode([user, *chat.encode("ab"), EOS]) == "ab"
    words = make_tokenizer(("go", "a"), TextConfig(template="chat"))
    assert words.vocab_size == 5 + len(ROLE_TOKENS)
    with pytest.raises(TokenizerError):
        words.encode("<|user|>")
    assert words.decode([words.special_id("<|tool|>"), *words.encode("go a")]) == "go a"
    with pytest.raises(TokenizerError, match="not in this tokenizer"):
        ByteTokenizer().special_id("<|user|>")


def test_template_config_errors_are_clear():
    with pytest.raises(ConfigError, match="text.template='nope'"):
        make_tokenizer(None, TextConfig(template="nope"))
    with pytest.raises(ConfigError, match="text.system"):
        make_tokenizer(("go",), TextConfig(template="chat", system="hello there"))
    with pytest.raises(ConfigError, match="not a headrace.text.template.ChatTemplate"):
        resolve("headrace.text.template:ROLE_TOKENS")
    assert resolve("headrace.text.template:CHAT") is CHAT
    assert make_tokenizer(None).template.name == PLAIN.name


class TwoTurnWords(Env):
    """A closed-vocabulary env answering every action with `ok` for two turns."""

    spec = EnvSpec(vocabulary=("go", "ok", "a", "b"), action_words=("a", "b"), max_turns=2)
    blocking = False

    def reset(self, seed):
        return "go", {}

    def step(self, action):
        return "ok", 0.5, False, False, {}


@pytest.mark.timeout(60)
def test_one_token_actions_under_chat_are_closed_by_the_template():
    tokenizer = make_tokenizer(TwoTurnWords.spec.vocabulary, TextConfig(template="chat"))
    sampler = RecordingSampler(lambda ctx: list(tokenizer.ids_of(["a"])))
    result = play(TwoTurnWords(), 0, sampler, tokenizer)
    assert result.status == "truncated" and result.reward == 1.0
    assert_recorded_exactly(result, sampler.calls)
    a = tokenizer.ids_of(["a"])[0]
    tokens = result.builder.tokens
    closers = [i for i, t in enumerate(tokens[:-1]) if t == a]
    assert all(tokens[i + 1] == EOS for i in closers)  # closed before the next turn
