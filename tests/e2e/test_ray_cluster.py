"""`headrace bench cluster`: guess_number trains under `run.launcher: ray` on a local Ray cluster
(a head and two worker nodes with custom resources, started and stopped by the bench), with the
actors on the worker nodes and the buffer's Redis on the head (from Ray's placement), one worker
node killed mid-run (its actor restarts on the other), the run reaching its step limit, and the
accounting identity exact from the ledger. The bench exits non-zero when any of that breaks (or a
Ray process outlives its cluster), so its exit status and figures are what a broken mechanism
would fail."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from headrace.benchlib import LEARNED_SUCCESS_N8
from headrace.benchmarks.cluster import STEPS
from headrace.buffer.server import RedisServerError, find_redis_server

ROOT = pathlib.Path(__file__).resolve().parents[2]
KEYS = ["nodes", "actors_per_node", "buffer_node", "node_killed", "actor_restarts", "steps", "success_rate",
        "written", "trained", "dropped", "in_buffer", "lost", "trained_twice", "quarantined",
        "identity_exact", "wall_s"]


@pytest.mark.xdist_group("ray")  # one Ray cluster at a time: each wants both cores
@pytest.mark.slow  # ~70 s idle: learning needs the steps
@pytest.mark.timeout(900)
def test_cluster_trains_through_a_killed_worker_node():
    pytest.importorskip("ray")
    try:
        find_redis_server()
    except RedisServerError as error:
        pytest.skip(str(error))
    result = subprocess.run(
        [sys.executable, "-m", "headrace.cli", "bench", "cluster", "--json"],
        capture_output=True, text=True, timeout=880, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(result.stdout)  # stdout is exactly one JSON object
    assert list(data) == KEYS
    assert data["nodes"] == 3
    before, after = data["actors_per_node"]["before"], data["actors_per_node"]["after"]
    # SPREAD over the two worker nodes: one actor each; after the kill both on the survivor.
    assert sorted(before.values()) == [1, 1]
    assert data["node_killed"] in before and data["node_killed"] not in after
    assert list(after.values()) == [2] and set(after) < set(before)
    assert data["buffer_node"] not in before and data["buffer_node"] is not None  # the head
    assert data["actor_restarts"] >= 1
    assert data["steps"] == STEPS
    assert data["success_rate"] >= LEARNED_SUCCESS_N8
    assert data["lost"] == 0 and data["trained_twice"] == 0 and data["identity_exact"] is True
    assert data["trained"] == STEPS * 8  # every step's 8 groups, each trained once
    parts = data["trained"] + sum(data["dropped"].values()) + data["quarantined"] \
        + data["in_buffer"]
    assert parts == data["written"]
