"""`headrace bench envs --quick --json` runs every example and prints every promised figure."""

import json
import subprocess
import sys

import pytest

FIGURES = ("learner_steps_per_s", "actor_env_s_p50", "actor_env_s_p99", "reward_mean_first",
           "reward_mean_last", "eval_curve", "final_success_rate", "steps")


@pytest.mark.timeout(300)
def test_quick_bench_reports_every_environment():
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "envs", "--quick",
                             "--json"], capture_output=True, text=True, timeout=280)
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
        assert figures["steps"] >= 1 and figures["errors"] == [], (name, figures)
        # steady-state steps/s leaves out steps that compiled: 0 when a quick run had no other
        assert figures["learner_steps_per_s"] >= 0, (name, figures)
    calc = envs["tool_calculator"]
    for key in FIGURES:
        assert key in calc["no_tool"], key
    assert calc["tool_gain"] == calc["final_success_rate"] - calc["no_tool_final_success_rate"]
    assert set(calc["sft"]) == {"tool", "no_tool"}
    lake = envs["gym_frozenlake"]
    assert 0 <= lake["random_success_rate"] < 0.1 and "initial_success_rate" in lake
    assert envs["http_tool"]["http"]["requests"] > 0  # the policy really called the service
