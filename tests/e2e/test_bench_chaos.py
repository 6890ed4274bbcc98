"""`headrace bench chaos --quick`: a real processes run (embedded Redis, fsync always, ledger)
with the learner, an actor, the Redis server and the whole process tree SIGKILLed under it, the
accounting identity checked exactly after each fault; the bench exits non-zero when a promise
breaks, so its exit status and figures are what a broken mechanism would fail."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from headrace.buffer.server import RedisServerError, find_redis_server

ROOT = pathlib.Path(__file__).resolve().parents[2]
KEYS = ["faults", "steps", "written", "trained", "dropped", "quarantined", "in_buffer", "lost",
        "trained_twice", "identity_exact", "final_success_rate"]


@pytest.mark.timeout(1200)
def test_quick_chaos_loses_nothing_and_trains_nothing_twice(tmp_path):
    try:
        find_redis_server()
    except RedisServerError as error:
        pytest.skip(str(error))
    result = subprocess.run(
        [sys.executable, "-m", "headrace.cli", "bench", "chaos", "--quick", "--json",
         "--keep", str(tmp_path / "chaos")],
        capture_output=True, text=True, timeout=1180, cwd=ROOT)
    log = tmp_path / "chaos" / "train.log"  # the run's own log: stacks of a hang end up there
    assert result.returncode == 0, (result.stderr[-4000:]
                                    + (log.read_text()[-12000:] if log.exists() else ""))
    data = json.loads(result.stdout)  # stdout is exactly one JSON object
    assert list(data) == KEYS
    assert data["faults"] == {"learner": 1, "actor": 1, "redis": 1, "tree": 1}
    assert data["lost"] == 0 and data["trained_twice"] == 0 and data["identity_exact"] is True
    # The run trained past its last fault (at step 6 + 3 x 6 or later) and 4 steps more, in
    # groups of 8, every trained group once, and the parts add up to what was written.
    assert data["steps"] >= 6 + 3 * 6 + 4
    assert data["trained"] == data["steps"] * 8
    parts = data["trained"] + sum(data["dropped"].values()) + data["quarantined"] \
        + data["in_buffer"]
    assert parts == data["written"]
    checks = [line for line in result.stderr.splitlines() if "exact True" in line]
    assert len(checks) == 5, result.stderr[-3000:]  # after each fault, and at the end
    assert (tmp_path / "chaos" / "run" / "ledger").is_dir()
    record = json.loads((tmp_path / "chaos" / "run" / "run.json").read_text())
    assert len(record["resumes"]) == 2  # after the learner's death and after the tree's
