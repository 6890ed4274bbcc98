"""`headrace sft`: demonstrations (solver and JSONL), the warm-up through the real command line,
and `headrace train` starting from its checkpoint (`model.init_from`), with clear errors."""

import copy
import json
import subprocess
import sys

import pytest

from headrace.config import ConfigError, load
from headrace.runtime import build
from headrace.sft import SftError, check_init_from
from headrace.sft.demos import ActionCoder, read_jsonl, solver_demos

CALC = {
    "run": {"seed": 0, "log_every": 5, "launcher": "threads", "eval_every": 0},
    "env": {"name": "tool_calculator", "kwargs": {"digits": 1, "terms": 2, "ops": "+",
                                                  "max_turns": 3}},
    "text": {"template": "chat", "observation_role": "tool"},
    "model": {"preset": "tiny", "max_len": 64},
    "sampling": {"max_new_tokens": 12},
    "actor": {"envs_per_actor": 16, "group_size": 4, "max_batch": 16},
    "learner": {"groups_per_batch": 2, "optimizer": {"lr": 1.0e-9}},
    "buffer": {"capacity": 4, "max_pending": 64},
    "shapes": {"buckets": [32, 64]},
    "sft": {"episodes": 64, "steps": 40, "batch_size": 16, "lr": 3.0e-3, "eval_every": 20,
            "eval_episodes": 64},  # headrace train evaluates the same 64 tasks
}


def calc(*overrides):
    """The calculator config (a deep copy: loading with overrides edits nested dicts in place)."""
    return load(data=copy.deepcopy(CALC), overrides=list(overrides))


def coder_for(config):
    task = build.build_task(config)
    s = task.sampler_settings
    return task, ActionCoder(task.tokenizer, s.allowed_ids, s.max_new_tokens)


def test_solver_demos_replay_the_environment_and_train_on_actions_only():
    config = calc("sft.episodes=3")
    task, coder = coder_for(config)
    demos, failures = solver_demos(config, task.make_env, coder)
    assert failures == 0 and len(demos) == 3 and all(d.success for d in demos)
    tokens, mask, _, _ = demos[0].renderer.builder.arrays()
    trained = task.tokenizer.decode(tokens[mask])
    expr, value = task.make_env().question_for(0)
    assert trained == f"calc: {expr}answer: {value}"  # the two actions (their <eos> decode to "")
    assert (tokens[mask][-1]) == 2  # the turn ends with <eos>, which the policy must learn


def test_jsonl_demos_both_forms_and_errors_name_the_line(tmp_path):
    config = calc()
    task, coder = coder_for(config)
    path = tmp_path / "demos.jsonl"
    path.write_text("\n".join([
        "# a comment",
        json.dumps({"seed": 4, "actions": ["calc: 1+2", "answer: 3"]}),
        "",
        json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "What is 1+1?"},
                                 {"role": "assistant", "content": "answer: 2"}]}),
    ]))
    demos = read_jsonl(path, task.make_env, task.tokenizer, coder)
    assert len(demos) == 2
    assert [t.role for t in demos[1].renderer.builder.turns] == ["system", "user", "assistant"]
    bad = {
        '{"seed": 1}': "expected",
        '{"seed": 1, "actions": ["answer: 1", "answer: 2"]}': "episode ended after 1 actions",
        '{"messages": [{"role": "assistant", "content": "x"}]}': "must be the user",
        '{"messages": [{"role": "user", "content": "x"}]}': "no assistant message",
        '{"seed": 1, "actions": ["answer: ' + "9" * 30 + '"]}': "sampling.max_new_tokens",
        "not json": "not JSON",
    }
    for line, message in bad.items():
        path.write_text("\n" + line + "\n")
        with pytest.raises(SftError, match=message) as info:
            read_jsonl(path, task.make_env, task.tokenizer, coder)
        assert f"{path}:2" in str(info.value)
    with pytest.raises(SftError, match="no such file"):
        read_jsonl(tmp_path / "missing.jsonl", task.make_env, task.tokenizer, coder)


def test_an_env_without_solver_is_refused_with_the_fix():
    config = load(data={"env": {"name": "guess_number"}, "sampling": {"max_new_tokens": 1},
                        "model": {"max_len": 64}, "shapes": {"buckets": [8, 16]}})
    task, coder = coder_for(config)
    with pytest.raises(SftError, match="no demonstration solver.*sft.demos: PATH.jsonl"):
        solver_demos(config, task.make_env, coder)


def test_constrained_actions_must_be_one_action_word():
    config = load(data={"env": {"name": "gym", "kwargs": {"id": "FrozenLake-v1",
                                                          "is_slippery": False}},
                        "sampling": {"max_new_tokens": 1}, "model": {"max_len": 64},
                        "shapes": {"buckets": [16, 32]}})
    task, coder = coder_for(config)
    assert coder.encode("left", "x") == list(task.tokenizer.ids_of(["left"]))
    with pytest.raises(SftError, match="not one of the environment's action words"):
        coder.encode("s0", "x")


def test_init_from_bad_paths_are_config_errors(tmp_path):
    dims = build.build_task(calc()).dims
    cases = {str(tmp_path / "missing"): "no such folder", str(tmp_path): "not a run folder"}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("{}\n")
    cases[str(tmp_path / "run")] = "holds no checkpoint"
    for path, message in cases.items():
        config = calc(f"model.init_from={path}")
        with pytest.raises(ConfigError, match=message):
            check_init_from(config, dims)


@pytest.mark.timeout(300)
def test_demonstrations_over_the_largest_bucket_are_counted_or_refused(tmp_path):
    from headrace.runtime import sft

    # Every calculator demonstration (a chat-rendered episode) is longer than 16 tokens.
    small = ("shapes.buckets=[16]", "sft.episodes=4", "sft.steps=2", "sft.batch_size=4",
             "sft.eval_every=0", "sft.eval_episodes=4", "run.log_every=1")
    with pytest.raises(SftError, match="every demonstration is longer than the largest bucket "
                       r"\(16 tokens.*Raise shapes.buckets"):
        sft.run(calc(*small, "shapes.overlong=reject", f"sft.dir={tmp_path}/reject"), echo=False)
    summary = sft.run(calc(*small, f"sft.dir={tmp_path}/cut"), echo=False)
    assert summary["batch_truncated"] == 2 * 4 and summary["batch_rejected"] == 0, summary
    records = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text()
               .splitlines()]
    # every line carries the count so far: 4 demonstrations a step, cut to the bucket
    assert [r["batch/truncated"] for r in records][:2] == [4, 8], records


def cli(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "headrace.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.timeout(420)
def test_sft_then_train_starts_from_its_checkpoint(tmp_path):
    config = tmp_path / "calc.yaml"
    config.write_text(json.dumps(CALC))  # JSON is YAML
    sft_dir = tmp_path / "sft"
    result = cli("sft", str(config), "--json", "--set", f"sft.dir={sft_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)  # stdout is exactly one JSON object
    assert summary["demos"] == 64 and summary["steps"] == 40 and summary["demo_success_rate"] == 1
    assert summary["final_success_rate"] > summary["initial_success_rate"]
    records = [json.loads(line) for line in (sft_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["sft/loss"] < records[0]["sft/loss"] / 2
    assert any(p.name.isdigit() for p in (sft_dir / "checkpoints").iterdir())

    # A learning rate of 1e-9 leaves the warm-started weights as they were: the greedy policy
    # of `headrace train` after one step is the warm-up's, on the same evaluation tasks.
    result = cli("train", str(config), "--json", "--set", f"run.dir={tmp_path}/train",
                 "--set", f"model.init_from={sft_dir}", "--set", "run.max_steps=1",
                 "--set", "run.max_wall_s=0")
    assert result.returncode == 0, result.stderr[-3000:]
    trained = json.loads(result.stdout)
    assert trained["steps"] == 1
    assert trained["final_success_rate"] == summary["final_success_rate"]

    # Another template than the warm-up's is refused before anything starts.
    result = cli("train", str(config), "--set", f"run.dir={tmp_path}/bad",
                 "--set", f"model.init_from={sft_dir}", "--set", "text.template=plain")
    assert result.returncode == 2
    assert "text.template='chat'" in result.stderr and "use the same template" in result.stderr
