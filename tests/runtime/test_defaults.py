"""The defaults are crash-safe and say one thing: the processes launcher over the embedded Redis
and the directory weight store, periodic checkpoints; a contradiction is refused by name."""

import pathlib

import pytest

from headrace.config import Config, ConfigError, load
from headrace.runtime import build

EXAMPLES = sorted(p for p in (pathlib.Path(__file__).resolve().parents[2] / "examples").glob("*.yaml")
                  if p.stem != "simulate_large")  # a simulation spec, not a run config


def test_the_default_config_is_the_crash_safe_one():
    config = Config()
    assert config.run.launcher == "processes"
    assert (config.buffer.backend, config.weights.backend) == ("redis", "dir")
    assert config.run.checkpoint_every > 0  # acknowledgements wait for a checkpoint
    build.check_flow(config)  # and the defaults fit the pending bound that implies


def test_the_threads_launcher_chooses_the_memory_backends():
    config = load(data={"run": {"launcher": "threads"}})
    assert (config.buffer.backend, config.weights.backend) == ("memory", "memory")
    redis = load(data={"run": {"launcher": "threads"}, "buffer": {"backend": "redis"}})
    assert redis.buffer.backend == "redis"  # the threads launcher may embed a Redis


@pytest.mark.parametrize("section", ["buffer", "weights"])
def test_memory_under_the_processes_launcher_is_refused_by_name(section):
    with pytest.raises(ConfigError) as error:
        load(data={"run": {"launcher": "processes"}, section: {"backend": "memory"}})
    message = str(error.value)
    assert f"{section}.backend='memory'" in message and "run.launcher='processes'" in message
    assert "share no memory" in message


def test_a_resolved_config_round_trips():
    config = load(data={"run": {"launcher": "threads"}})
    assert load(data=config.to_dict()) == config


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_loads_without_a_contradiction_and_fits_its_flow(path):
    config = load(path)
    if config.run.launcher == "processes":
        assert (config.buffer.backend, config.weights.backend) == ("redis", "dir")
    build.check_flow(config)
