"""`headrace bench gateway --quick --json`: the gateway's cost over the engine alone, measured on
the same recorded contexts; what a broken bench would fail: calls lost, histories that stopped
matching their record, latencies that are not the difference they claim."""

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_quick_gateway_bench_measures_both_paths():
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "gateway", "--quick",
                             "--json"], capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    assert data["quick"] and data["turns"] == 2 and set(data["levels"]) == {"1", "8"}
    for name, level in data["levels"].items():
        n = int(name)
        assert level["sessions"] == n and level["calls"] == n * data["turns"]  # none lost
        assert level["new_segments"] == 0  # every history matched: the recorded tokens replayed
        for key in ("gateway_requests_per_s", "engine_requests_per_s", "gateway_p50_ms",
                    "engine_p50_ms", "server_p50_ms", "server_engine_p50_ms"):
            assert level[key] > 0, (name, key, level)
        assert level["gateway_p99_ms"] >= level["gateway_p50_ms"]
        assert level["added_p50_ms"] == pytest.approx(level["gateway_p50_ms"]
                                                      - level["engine_p50_ms"])
        assert level["added_p99_ms"] == pytest.approx(level["gateway_p99_ms"]
                                                      - level["engine_p99_ms"])
        # the server's handler contains its engine wait
        assert level["server_p50_ms"] >= level["server_engine_p50_ms"]
