"""`headrace bench learner --quick --json` through the real command line: each dtype x remat
variant is built the way a run builds its learner step, and the figures show the switch took:
bfloat16 compiles a program that computes in bfloat16 (float32 one that does not), and remat
recomputes the forward pass (more floating-point operations in XLA's own count)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(600)
def test_quick_bench_builds_each_variant_and_the_switches_take():
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "learner", "--quick",
                             "--json"], capture_output=True, text=True, timeout=580)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    variants = out["variants"]
    assert set(variants) == {"float32/none", "float32/block", "bfloat16/none", "bfloat16/block"}
    tokens = out["group_size"] * out["groups_per_step"] * (out["prompt_len"] + out["answer_len"])
    for name, row in variants.items():
        assert row["tokens_per_step"] == tokens, name  # every episode placed whole
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["gflop_per_step"] > 0, name
    for remat in ("none", "block"):
        assert variants[f"float32/{remat}"]["bf16_ops"] == 0
        assert variants[f"bfloat16/{remat}"]["bf16_ops"] > 0
    for dtype in ("float32", "bfloat16"):
        # The backward pass of `block` runs each block's forward again.
        assert variants[f"{dtype}/block"]["gflop_per_step"] \
            > variants[f"{dtype}/none"]["gflop_per_step"]
        # The sampler is measured once per dtype, on the first variant of it.
        assert variants[f"{dtype}/none"]["sampler_tokens_per_s"] > 0
