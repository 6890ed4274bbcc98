"""`headrace bench buffer --shards 1,2 --quick --json`: one object with a row per shard count;
every group written is delivered exactly once across the shards and every shard received some
(what broken routing or broken shares would fail; the bench itself exits 1 then)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_bench_buffer_shards_quick_delivers_everything_once_on_every_shard():
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "buffer", "--shards",
                             "1,2", "--quick", "--json"], capture_output=True, text=True,
                            timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert set(out) == {"shards", "ratio_2_to_1", "cores", "servers_per_core", "exactly_once"}
    assert set(out["shards"]) == {"1", "2"} and out["exactly_once"] is True
    for n, row in out["shards"].items():
        assert len(row["written_per_shard"]) == int(n) and min(row["written_per_shard"]) > 0
        assert row["delivered"] == row["written"] == sum(row["written_per_shard"]) > 0
        assert row["throughput_per_s"] > 0 and row["put_ms_p99"] >= row["put_ms_p50"] > 0
    assert out["ratio_2_to_1"] == pytest.approx(
        out["shards"]["2"]["throughput_per_s"] / out["shards"]["1"]["throughput_per_s"])


def test_bench_buffer_refuses_a_bad_shard_list():
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "buffer", "--shards",
                             "1,x", "--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--shards" in result.stderr
    assert "Traceback" not in result.stderr
