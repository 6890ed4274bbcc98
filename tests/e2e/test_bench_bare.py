"""`headrace bench bare`: its vectorised rollout plays guess_number by the real environment's rules
(replayed through `GuessNumber` action by action), and the quick run through the command line
reports a curve of greedy evaluations at the updates it made."""

import dataclasses
import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from headrace.config import load
from headrace.env.guess_number import GuessNumber

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
    from headrace.benchmarks import bare

    return bare


@pytest.mark.timeout(300)
def test_rollout_follows_the_environment_rules():
    config = load(ROOT / "examples" / "guess_number.yaml")
    config = dataclasses.replace(config, learner=dataclasses.replace(
        config.learner, groups_per_batch=8, minibatches=1))
    bare = _bench().Bare(config)
    tokens, on, behaviour, reward, success, secrets = (
        np.asarray(x) for x in jax.jit(bare.rollout)(bare.params, jax.random.key(3)))
    words = bare.task.tokenizer.words
    env = GuessNumber(n=32, max_turns=5, turn_penalty=0.01)
    group = config.actor.group_size
    assert (secrets.reshape(-1, group) == secrets[::group, None]).all()  # one task per group
    for row in range(tokens.shape[0]):
        actions = [words[t] for t in tokens[row][on[row]]]
        assert 1 <= len(actions) <= 5 and all(a.isdigit() for a in actions), actions
        # replay the row's actions through the environment, with the row's secret
        env._secret, env._turns = int(secrets[row]), 0  # the env's own state for this task
        seq, total, done, won = [words[tokens[row, 1]]], 0.0, False, False
        for a in actions:
            assert not done, (row, actions)  # the row went on after the env ended the episode
            seq.append(a)
            obs, r, terminated, truncated, info = env.step(a)
            total, won, done = total + r, info["success"], terminated or truncated
            if not done:
                seq.append(obs)
        assert done, (row, actions)  # the row stopped before the env ended the episode
        assert seq == [w for w in (words[t] for t in tokens[row][1:]) if w != "<pad>"], row
        assert words[tokens[row, 0]] == "<bos>"
        assert reward[row] == pytest.approx(total, abs=1e-6) and success[row] == won, row
        assert np.all(behaviour[row][on[row]] < 0) and np.all(behaviour[row][~on[row]] == 0)
    assert 0 < success.sum() < len(success)  # both outcomes occur, so both were checked


@pytest.mark.timeout(600)
def test_quick_bare_run_reports_a_curve():
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "bare", "--quick",
                             "--json"], capture_output=True, text=True, timeout=580, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "failed" not in result.stderr, result.stderr[-3000:]  # every evaluation episode played
    data = json.loads(result.stdout)
    (run,) = data["runs"]
    assert run["steps"] == 4 and run["updates"] == 4 * data["settings"]["updates_per_step"]
    assert [p["updates"] for p in run["eval_curve"]] == [4, 8]  # every 2 steps, 2 updates each
    for point in run["eval_curve"]:
        assert 0 <= point["success"] <= 1 and point["wall_s"] >= run["compile_s"]
    assert run["rollout_s"] > 0 and run["update_s"] > 0
    assert data["reached"].endswith("/1")
