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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loss_agg", ["token_mean", "sequence_mean", "token_sum"])
def test_the_bare_loss_weights_are_the_learners(loss_agg):
    """The same rollout, as the learner's batcher sees it (one trajectory per row, its tokens up
    to its last), gets the same per-token weights and advantages in the bare loop (compared as
    multisets: the batcher packs rows its own way)."""
    from headrace.learner.batching import Batcher
    from headrace.metrics.core import Metrics
    from headrace.types import Group, Trajectory

    config = load(ROOT / "examples" / "guess_number.yaml", [
        "learner.groups_per_batch=8", "learner.minibatches=1", f"learner.loss_agg={loss_agg}"])
    bare = _bench().Bare(config)
    tokens, on, behaviour, reward, _, _ = (
        np.asarray(x) for x in jax.jit(bare.rollout)(bare.params, jax.random.key(5)))
    want = {k: np.asarray(v) for k, v in bare.microbatch(tokens, on, behaviour, reward).items()}
    size, groups = config.actor.group_size, []
    for g in range(tokens.shape[0] // size):
        rows = range(g * size, (g + 1) * size)
        ends = [int(np.flatnonzero(tokens[r] != bare.pad).max()) + 1 for r in rows]
        groups.append(Group(f"g{g}", f"t{g}", [Trajectory(
            trajectory_id=f"g{g}.{r}", group_id=f"g{g}", task_id=f"t{g}", env="guess_number",
            actor_id="a", tokens=tokens[r, :n], loss_mask=on[r, :n],
            behaviour_logprobs=behaviour[r, :n], policy_version=np.zeros(n, np.int32),
            turns=[], reward=float(reward[r])) for r, n in zip(rows, ends)]))
    batch = Batcher(config.learner, config.shapes, Metrics()).build(groups)
    (microbatch,) = batch.microbatches
    got = microbatch.arrays
    weights = np.sort(got["weight"][got["weight"] > 0])
    np.testing.assert_allclose(weights, np.sort(want["weight"][want["weight"] > 0]), rtol=1e-6)
    assert got["weight"].sum() == pytest.approx(want["weight"].sum(), rel=1e-6)
    np.testing.assert_allclose(np.sort(got["advantages"][got["loss_mask"] > 0]),
                               np.sort(want["advantages"][on]), atol=1e-6)


@pytest.mark.timeout(300)
def test_dynamic_sampling_trains_on_groups_whose_rewards_differ():
    """With `learner.drop_uniform_groups` the bare loop rolls out until it has the step's groups
    with unequal rewards, as the learner's feed fills its batch."""
    from headrace.learner.advantages import uniform

    config = load(ROOT / "examples" / "guess_number.yaml", [
        "learner.drop_uniform_groups=true"])  # 32 groups: P(no uniform one) ~ 0.75^32
    bare = _bench().Bare(config)
    dynamic = _bench().DynamicSampling(bare)
    rollout = jax.device_get(dynamic.rollout(bare.params, jax.random.key(0)))
    g = config.actor.group_size
    groups = rollout[3].reshape(-1, g)
    assert any(uniform(r, np.ones(g, bool)) for r in groups)  # the initial policy makes some
    tokens, on, behaviour, reward, success = dynamic.gather(bare.params, jax.random.key(1))
    need = config.learner.groups_per_batch * g
    assert tokens.shape == (need, bare.width) and len(reward) == len(success) == need
    assert not any(uniform(r, np.ones(g, bool)) for r in reward.reshape(-1, g))
    assert dynamic.rollouts >= 2  # one rollout of 32 groups hardly ever has 32 that differ
    assert (success == (reward > 0)).all() and on.any(axis=1).all()
    # past the step's limit (here 2 groups) those with equal rewards are trained too
    config = load(ROOT / "examples" / "guess_number.yaml", [
        "learner.drop_uniform_groups=true", "learner.uniform_drop_limit=0.04"])
    dynamic = _bench().DynamicSampling(_bench().Bare(config))
    reward = dynamic.gather(bare.params, jax.random.key(1))[3]
    assert dynamic.drops.dropped == 2 and dynamic.rollouts == 2
    assert any(uniform(r, np.ones(g, bool)) for r in reward.reshape(-1, g))


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
    assert run["cpu_s_per_step"] > 0 and run["cores_busy"] > 0
    assert data["reached"].endswith("/1")


def test_a_headrace_run_is_read_for_the_comparison(tmp_path):
    """Time and steps to the target from the run's summary (the first evaluation at it), CPU per
    step from its steady-state metrics: the learner's since its first step plus each actor's
    median reading, over the learner's steps per second."""
    bare = _bench()
    text = (ROOT / "examples" / "guess_number.yaml").read_text()
    (tmp_path / "config.yaml").write_text(text.replace("num_actors: 1", "num_actors: 2"))
    curve = [{"wall_s": 10.0, "step": 40, "success_rate": 0.5},
             {"wall_s": 20.0, "step": 80, "success_rate": 0.9},
             {"wall_s": 30.0, "step": 120, "success_rate": 0.95}]
    (tmp_path / "summary.json").write_text(json.dumps({"time_to_target_s": 20.5,
                                                       "eval_curve": curve}))
    records = [{"time": 1.0, "step": 0, "actor/cpu_frac": 5.0},  # before the first step: not read
               {"time": 2.0, "step": 1, "learner/step": 1, "actor/cpu_frac": 0.7},
               {"time": 3.0, "step": 2, "learner/step": 2, "actor/cpu_frac": 0.8},
               {"time": 4.0, "step": 3, "learner/step": 3, "actor/cpu_frac": 0.9,
                "learner/cpu_frac": 0.9, "learner/steps_per_s": 10.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    got = bare.headrace_run(tmp_path)
    assert got["time_to_target_s"] == 20.5 and got["steps_to_target"] == 80
    assert got["cpu_s_per_step"] == pytest.approx((0.9 + 0.8 * 2) / 10.0)
    threads = text.replace("launcher: processes", "launcher: threads")
    assert threads != text
    (tmp_path / "config.yaml").write_text(threads)  # one process: the learner's figure is all
    assert bare.headrace_run(tmp_path)["cpu_s_per_step"] == pytest.approx(0.9 / 10.0)
    assert bare._ratio([3.0, None, 1.0, 2.0], [None, 4.0]) == pytest.approx(0.5)
    assert bare._ratio([None], [1.0]) is None


def test_a_folder_without_a_summary_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no summary.json there"):
        _bench().headrace_run(tmp_path)
