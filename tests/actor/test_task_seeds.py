"""Task seeds are a stable function of `run.seed` and the actor id: two processes with different
string-hash salts (PYTHONHASHSEED) draw the same task stream, and no actor plays an evaluation seed."""

import json
import os
import subprocess
import sys

import pytest

from headrace.actor.evaluate import EVAL_SEEDS_START, eval_seeds
from headrace.env.registry import ACTOR_SEEDS_START, task_seed_start

# Builds a real Actor and draws the first task seeds of its stream, as its group slots do.
SCRIPT = """
import json, sys
from headrace.actor.actor import Actor
from headrace.config import load

streams = {}
for seed in (0, 1):
    config = load(data={"run": {"seed": seed}})
    for actor_id in ("actor-0", "actor-1"):
        actor = Actor(config, actor_id, None, None, None, None, None, None, None)
        streams[f"{seed}/{actor_id}"] = [next(actor._task_seeds) for _ in range(4)]
print(json.dumps(streams))
"""


def _streams(hash_seed: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=100, check=True)
    return json.loads(out.stdout)


@pytest.mark.timeout(240)
def test_the_same_run_seed_gives_the_same_tasks_in_processes_with_different_hash_salts():
    first, second = _streams("1"), _streams("2")
    assert first == second
    # The stream depends on the run seed and the actor id, and is consecutive within an actor.
    assert len({s[0] for s in first.values()}) == 4
    for stream in first.values():
        assert stream == list(range(stream[0], stream[0] + 4))
        assert stream[0] >= ACTOR_SEEDS_START
    # Python's salted string hash differs between the two processes: the old seeding would too.
    hashes = [subprocess.run([sys.executable, "-c", "print(hash('actor-0'))"], text=True,
                             capture_output=True, timeout=30, check=True,
                             env={**os.environ, "PYTHONHASHSEED": s}).stdout for s in "12"]
    assert hashes[0] != hashes[1]


def test_actor_streams_stay_above_the_held_out_evaluation_seeds():
    class NoEvalSeeds:  # an environment without its own evaluation set
        pass

    held_out = eval_seeds(NoEvalSeeds(), 64)
    assert held_out == list(range(EVAL_SEEDS_START, EVAL_SEEDS_START + 64))
    for run_seed in (-3, 0, 1, 2**40):
        for i in range(32):
            start = task_seed_start(run_seed, f"actor-{i}")
            assert ACTOR_SEEDS_START <= start and start + 10**6 < 2**63
    with pytest.raises(ValueError, match="episodes=0"):
        eval_seeds(NoEvalSeeds(), 0)
