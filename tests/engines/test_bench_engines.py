"""`headrace bench engines --quick --json` through the real command line (needs .venv-vllm):
both engines measured at every batch size, each cell a real timing (no rates compared: the
machine's load could invert them)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(1200)
def test_bench_engines_quick_measures_both_engines_at_each_batch(vllm_python):
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "engines", "--quick",
                             "--json"], capture_output=True, text=True, timeout=1150)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["vllm"].get("ready_s", 0) > 0, report["vllm"]
    for engine, cells in (("jax", report["jax"]), ("vllm", report["vllm"]["batches"])):
        assert set(cells) == {"1", "4"}, (engine, cells)
        for batch, cell in cells.items():
            assert cell["tokens_per_s"] > 0 and cell["ttft_s"] > 0, (engine, batch, cell)
            # tokens/s is the batch's generated tokens over the timed call
            assert cell["tokens_per_s"] == pytest.approx(int(batch) * 8 / cell["call_s"])
