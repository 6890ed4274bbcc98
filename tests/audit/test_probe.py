"""The sampler probe plays episodes in lockstep, one timed call per turn of each row count, in a
child set up as an actor, with and without kept caches (with more probed rows than the config's
slots: the child gives itself one per row); then runs an actor at a light and a heavy load, each
of whose policy calls serves between one turn and one per environment."""

import numpy as np
import pytest

from headrace.config import load
from headrace.runtime import probe


@pytest.mark.timeout(240)
@pytest.mark.parametrize("keep_cache", [False, True])
def test_probe_times_every_turn_of_each_row_count(tmp_path, keep_cache):
    config = load(data={
        "run": {"dir": str(tmp_path)},
        "env": {"name": "guess_number", "kwargs": {"n": 8, "max_turns": 3},
                "latency": {"kind": "lognormal", "seconds": 0.05}},
        "model": {"max_len": 64},
        "sampling": {"max_new_tokens": 1, "constrain_to_actions": True, "keep_cache": keep_cache},
        "actor": {"envs_per_actor": 8, "max_batch": 64},  # fewer slots than probed rows
        "shapes": {"buckets": [4, 8, 12]},
    })
    lengths = (4, 7, 11)  # the last one is the longest context that fits (12 - 1 new token)
    probed = probe.probe(config, lengths, repeats=2, timeout_s=200, window_s=1.0)
    rows = probed.calls[:, 0].astype(int).tolist()
    assert rows == [r for r in (1, 8, 32) for _ in range(2 * len(lengths))]  # max_batch 64
    assert np.all(probed.calls[:, 1] > 0)
    assert probed.turns.shape == (2, 3) and np.all(probed.turns > 0)
    # The mechanism, not a rate: at each load every policy call served at least one turn and at
    # most one per environment of that load (which of the two loads batches more rows per call
    # depends on how loaded the machine is: a slow call lets more rows gather).
    rows_per_call = probed.turns[:, 0] / probed.turns[:, 1]
    envs = np.array([envs for envs, _ in probe.TURN_LOADS], np.float64)
    assert np.all(rows_per_call >= 1) and np.all(rows_per_call <= envs), rows_per_call
