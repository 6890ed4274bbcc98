"""`scripts/run.sh train`: the first argument is a CONFIG only when it is not an option.

HEADRACE_DRY_RUN=1 makes the wrapper print the command it would run (no set-up, nothing run),
so these cases check its argument handling in milliseconds.
"""

import os
import pathlib
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "run.sh"
DEFAULT = "examples/guess_number.yaml"


def _command(*args: str) -> str:
    result = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                            timeout=30, env={**os.environ, "HEADRACE_DRY_RUN": "1"})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.parametrize(("args", "expected"), [
    ((), f"train {DEFAULT}"),
    (("--json",), f"train {DEFAULT} --json"),
    (("--json", "--set", "run.max_steps=3"), f"train {DEFAULT} --json --set run.max_steps=3"),
    (("--set", "run.seed=1"), f"train {DEFAULT} --set run.seed=1"),
    (("examples/gym_cartpole.yaml", "--json"), "train examples/gym_cartpole.yaml --json"),
    (("--resume", "runs/a", "--json"), "train --resume runs/a --json"),
    (("--json", "--resume=runs/a"), "train --json --resume=runs/a"),
])
def test_train_options_without_a_config_train_the_default_example(args, expected):
    assert _command("train", *args) == f".venv/bin/headrace {expected}"


def test_an_unknown_command_is_refused_with_the_usage():
    result = subprocess.run(["bash", str(SCRIPT), "fly"], capture_output=True, text=True,
                            timeout=30, env={**os.environ, "HEADRACE_DRY_RUN": "1"})
    assert result.returncode == 2 and "usage:" in result.stderr
