"""`headrace bench weights --vllm --quick --json` through the real command line (needs
.venv-vllm): publish -> first token through a real vLLM server, full weights and LoRA. The bench
itself fails if a token after a publish is not stamped with the version just published; here
the figures are checked for what they mean (no rate compared: load could invert it)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(1200)
def test_bench_weights_vllm_quick_times_each_sync_and_lora_moves_adapters_only(vllm_python):
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "weights", "--quick",
                             "--vllm", "--sizes", "", "--json"], capture_output=True, text=True,
                            timeout=1150)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["checks_passed"] is True
    full, lora = report["vllm_tiny"], report["vllm_tiny_lora"]
    for case in (full, lora):
        assert case["repeats"] == 3
        # the total is the sum of its parts, each a real timing
        parts = case["publish_s_p50"] + case["load_s_p50"] + case["first_token_s_p50"]
        assert case["publish_to_first_token_s_p50"] > 0 and parts > 0
        assert case["server_start_s"] > case["load_s_p50"]  # an update is not a restart
    # full weights: the worker reads every parameter; LoRA: the adapters alone (rank 16 of a
    # 128-wide model: 7 projections x 2 layers, a fraction of the 1.6 MB of weights)
    assert full["loaded_mib"] == pytest.approx(full["published_mib"], rel=0.01)
    assert lora["loaded_mib"] < full["loaded_mib"] / 2 and lora["lora_rank"] == 16
