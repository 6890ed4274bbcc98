"""`headrace bench envs --quick --json` runs every example and prints every promised figure; each
quick run stops at its one step with the final evaluation there, and the service's requests add
up."""

import json

import pytest

from tests.e2e.benchrun import run_headrace

FIGURES = ("learner_steps_per_s", "actor_env_s_p50", "actor_env_s_p99", "reward_mean_first",
           "reward_mean_last", "eval_curve", "final_success_rate", "steps")


@pytest.mark.timeout(900)
def test_quick_bench_reports_every_environment():
    result = run_headrace(["bench", "envs", "--quick", "--json"], timeout_s=880)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)  # stdout is exactly one JSON object
    envs = data["envs"]
    assert set(envs) == {"gym_frozenlake", "tool_calculator", "http_tool", "python_exec",
                         "gym_cartpole"}
    for name, figures in envs.items():
        if "skipped" in figures:  # python_exec where the sandbox cannot start: say why
            assert name == "python_exec" and figures["skipped"]
            continue
        for key in FIGURES:
            assert key in figures, (name, key)
        # A quick run is one learner step (run.max_steps=1, no periodic evaluation): it stops
        # there, and its only evaluation is the final one, of that step. (Its steps/s is the
        # steady state's, which a single step that compiled does not have: rates are the full
        # benchmark's to report.)
        assert figures["steps"] == 1 and figures["errors"] == [], (name, figures)
        assert figures["stopped_by"] == "max_steps", (name, figures)
        assert figures["eval_curve"] == [[1, figures["final_success_rate"]]], (name, figures)
        assert figures["episodes"] >= 8, (name, figures)  # at least the trained group's
        assert 0 < figures["actor_env_s_p50"] <= figures["actor_env_s_p99"], (name, figures)
    calc = envs["tool_calculator"]
    for key in FIGURES:
        assert key in calc["no_tool"], key
    assert calc["tool_gain"] == calc["final_success_rate"] - calc["no_tool_final_success_rate"]
    assert set(calc["sft"]) == {"tool", "no_tool"}
    for warm in calc["sft"].values():  # quick warm-ups: 20 updates on 64 demonstrations
        assert warm["steps"] == 20 and warm["demos"] == 64, warm
        assert [p[0] for p in warm["eval_curve"]] == [0, 20], warm
    lake = envs["gym_frozenlake"]
    assert 0 <= lake["random_success_rate"] < 0.1 and "initial_success_rate" in lake
    http = envs["http_tool"]["http"]
    assert http["requests"] > 0  # the policy really called the service
    assert http["requests"] == http["ok"] + http["bad_request"] + http["failed"] + http["dropped"]
