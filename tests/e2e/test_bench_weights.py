"""`headrace bench weights --quick --json`: both stores pass the checks a broken store fails, and
those checks do fail on a store that writes its pointer first or moves the wrong bytes."""

import json
import subprocess
import sys
import time

import pytest

from headrace.weights.redis_store import RedisWeightStore

KEYS = ("params", "dtype", "param_mib", "publish_s_p50", "pickup_s_p50", "pickup_s_p90",
        "pickup_device_s_p50", "pickup_device_s_p90", "load_s_p50", "published_mib",
        "loaded_mib", "publisher_peak_rss_mib", "reader_peak_rss_mib", "all_equal",
        "pointer_last")


def _bench():
    from headrace.benchmarks import weights

    return weights


@pytest.mark.timeout(600)
def test_quick_bench_passes_its_checks_on_both_stores():
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "weights",
                             "--quick", "--json"], capture_output=True, text=True, timeout=580)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    assert data["checks_passed"] is True
    for kind in ("dir_1M", "redis_1M"):
        case = data[kind]
        for key in KEYS:
            assert key in case, (kind, key)
        assert case["all_equal"] and case["pointer_last"]
        assert case["param_mib"] <= case["published_mib"] <= case["param_mib"] * 1.01 + 0.07
        assert case["param_mib"] <= case["loaded_mib"] <= case["param_mib"] * 1.01 + 0.07
        # (a reader may finish before publish returns: pruning comes after the pointer)
        assert case["publish_s_p50"] > 0 and 0 < case["pickup_s_p50"] <= case[
            "pickup_device_s_p50"]
        assert case["reader_peak_rss_mib"] > case["param_mib"]
    assert data["redis_1M"]["server_peak_mib"] > 2 * data["redis_1M"]["param_mib"]  # keep: 2
    for kind in ("dir_1M_lora", "redis_1M_lora"):  # adapters only: the same checks, fewer bytes
        case = data[kind]
        assert case["all_equal"] and case["pointer_last"] and case["lora_rank"] == 16
        assert case["param_mib"] <= case["published_mib"] <= case["param_mib"] * 1.01 + 0.07
        expected = sum(a * b for a, b in _bench().lora_shapes("1M").values()) + 1024  # + stamp
        assert case["params"] + 1024 == expected and case["param_mib"] == expected * 4 / 2**20
        assert 0 < case["bytes_vs_full"] < 0.5


def test_the_checks_fail_a_broken_store(tmp_path, redis_server):
    bench = _bench()
    # Directory: a pointer older than the version's files.
    root = tmp_path / "weights"
    (root / "v1").mkdir(parents=True)
    (root / "LATEST").write_text("1\n")
    time.sleep(0.05)
    (root / "v1" / "00000.bin").write_bytes(b"\0" * 8)
    assert not bench.PointerOrder({"kind": "dir", "path": str(root)}).check(1)
    # Redis: a store that sets the pointer before its chunks.
    store = RedisWeightStore(redis_server.url, "broken-bench", chunk_bytes=64)
    try:
        order = bench.PointerOrder({"kind": "redis"}, redis_server)
        time.sleep(0.2)  # MONITOR is on
        store._client.set(store.pointer_key, "1")
        store._client.hset(store.version_key(1), "00000:0", b"\0" * 8)
        assert not order.check(1)
    finally:
        store.close()
    # Bytes: twice the parameters moved, a stale version loaded.
    case = {"_param_bytes": 10**6, "all_equal": False, "pointer_last": True,
            "_rows": [{"wrote": 2 * 10**6, "read": 10**6, "monitored": False}]}
    failures = bench.check_quick("broken", case)
    assert any("wrote 2000000" in f for f in failures) and any("differs" in f for f in failures)
