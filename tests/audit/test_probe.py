"""The sampler probe plays episodes in lockstep, one timed call per turn of each row count, in a
child set up as an actor, with and without kept caches (with more probed rows than the config's
slots: the child gives itself one per row); then runs an actor at a light and a heavy load."""

import numpy as np
import pytest

from headrace.audit import probe
from headrace.config import load


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
    light, heavy = probed.turns[:, 0] / probed.turns[:, 1]  # rows per call
    assert heavy > light  # the heavy load's fast environments batch more rows per call
