"""Every example config runs with `headrace train` through the multi-process runtime (a few steps).

Each run is the example as a user would start it, shrunk with --set (two learner steps, one
group in flight, no periodic evaluation). http_tool runs as it is (`url: auto`: each process starts
its own loopback service); python_exec is skipped, with the reason, where the sandbox refuses to
start.
"""

import json
import pathlib
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ("tool_calculator", "http_tool", "python_exec", "gym_frozenlake", "gym_cartpole")
SMALL = ["--set", "run.max_steps=2", "--set", "run.eval_every=0", "--set", "run.max_wall_s=0",
         "--set", "actor.envs_per_actor=8", "--set", "actor.max_batch=8",
         "--set", "learner.groups_per_batch=1", "--set", "learner.minibatches=1"]


def test_every_builtin_environment_has_an_example():
    from headrace.env.registry import BUILTINS

    names = {yaml.safe_load((ROOT / "examples" / f"{e}.yaml").read_text())["env"]["name"]
             for e in (*EXAMPLES, "guess_number", "smollm2_reasoning", "gateway_reasoning")}
    assert set(BUILTINS) <= names


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", EXAMPLES)
def test_example_trains_through_processes(example, tmp_path):
    extra = []
    if example == "python_exec":
        from headrace.env.sandbox import SandboxUnavailable, probe

        try:
            probe()
        except SandboxUnavailable as error:
            pytest.skip(f"the sandbox refuses to start on this host: {error}")
    if example == "gym_cartpole":
        extra = ["--set", "env.kwargs.max_turns=20"]
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "headrace.cli", "train", f"examples/{example}.yaml", "--json",
         "--set", f"run.dir={run_dir}", *SMALL, *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["steps"] == 2 and summary["errors"] == [], summary
    assert summary["stopped_by"] == "max_steps"
    assert (run_dir / "run.json").exists()  # the processes launcher's run record
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["run"]["launcher"] == "processes"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last["actor/episodes"] >= 16
    assert "actor/env_s_p50" in last and "actor/env_s_p99" in last and "reward/mean" in last
