"""Config loading: types, ranges and unknown keys give one clear line; the CLI exits 2."""

import subprocess
import sys

import pytest

from headrace.config import Config, ConfigError, load


def test_defaults_are_valid():
    config = load(data={})
    assert isinstance(config, Config)
    assert config.model.d_model == 64


def test_example_loads_with_overrides():
    config = load("examples/guess_number.yaml", ["learner.optimizer.lr=3e-4", "actor.group_size=4"])
    assert config.learner.optimizer.lr == pytest.approx(3e-4)
    assert config.actor.group_size == 4


@pytest.mark.parametrize("override, message", [
    ("learner.groups_per_batch=0", "learner.groups_per_batch=0: must be >= 1"),
    ("learner.loss.kind=magic", "learner.loss.kind='magic': one of none, truncated_is"),
    ("actor.envs_per_actor=10", "actor.envs_per_actor=10: must be a multiple of actor.group_size=8"),
    ("model.d_model=hello", "model.d_model='hello': must be an integer"),
    ("sampling.temperature=0", "sampling.temperature=0.0: must be > 0"),
    ("learner.frobnicate=1", "learner.frobnicate: unknown key"),
    ("nosection.key=1", "nosection: unknown key"),
    ("run.launcher=magic", "run.launcher='magic': one of threads, processes, ray"),
    ("run.ray_actor_bundle={CPU: 0}", "run.ray_actor_bundle={'CPU': 0.0}: must name at least one "
     "resource with an amount > 0"),
    ("run.ray_learner_bundle={GPU: -1, CPU: 1}", "run.ray_learner_bundle={'GPU': -1.0, 'CPU': "
     "1.0}: must name"),
    ("shapes.buckets=[64, 32]", "shapes.buckets=(64, 32): must be strictly increasing"),
    ("staleness.forced_lag=9", "staleness.forced_lag=9: must be in [0, staleness.max_policy_lag=4]"),
    ("actor.cpu_threads=4", "actor.cpu_threads=4: must be 1: XLA gives an actor a thread per CPU it "
     "may use, so set the CPUs instead (run.actor_cpus)"),
    ("learner.precompile=true", "learner.precompile=True: needs fixed rows, so that every "
     "microbatch shape is known before the data: set learner.token_budget or "
     "shapes.rows_per_bucket"),
])
def test_bad_values_name_key_value_and_allowed(override, message):
    with pytest.raises(ConfigError) as error:
        load(data={}, overrides=[override])
    assert message in str(error.value)


def test_bad_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load(path)
    with pytest.raises(ConfigError, match="no such config file"):
        load(tmp_path / "missing.yaml")


@pytest.mark.timeout(120)
def test_cli_bad_config_exits_2_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "headrace.cli", "train", "examples/guess_number.yaml",
         "--set", "learner.minibatches=3", "--json"],
        capture_output=True, text=True, timeout=100)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "learner.minibatches=3: must divide learner.groups_per_batch=32" in lines[0]


@pytest.mark.timeout(120)
def test_cli_unknown_env_exits_2():
    result = subprocess.run(
        [sys.executable, "-m", "headrace.cli", "train", "examples/guess_number.yaml",
         "--set", "env.name=nosuch.module:Env"], capture_output=True, text=True, timeout=100)
    assert result.returncode == 2
    assert "env.name='nosuch.module:Env': cannot import nosuch.module" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_run_wall_clock_starts_at_the_program_start_or_at_the_python_call():
    """`headrace train` as a program counts `run.max_wall_s` from its process's start (JAX's
    start-up included); `main([...])` from a long-lived Python process counts from the call (a
    notebook hours old would otherwise stop every run at once)."""
    import time

    import psutil

    from headrace import cli

    before = time.time()
    assert before <= cli._start_time(["train"]) <= time.time()
    started = psutil.Process().create_time()
    assert abs(cli._start_time(None) - started) <= 1.0  # both read the kernel's clock ticks
