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


@pytest.mark.timeout(300)
def test_model_config_gives_random_weights_of_that_architecture_and_its_model_flops(tmp_path):
    """`--model-config` (the GPU script's path): a Qwen2-style config.json, tied embeddings and
    q/k/v biases, no checkpoint; the parameter count and the model FLOPs per token follow from
    the config alone, and mfu is their rate over `--peak-tflops`."""
    d, layers, heads, kv, ff, vocab = 32, 2, 4, 2, 64, 300
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": d,
              "intermediate_size": ff, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 512,
              "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "learner",
                             "--model-config", str(path), "--peak-tflops", "2", "--dtypes",
                             "float32", "--remats", "none", "--steps", "1", "--prompt-len", "20",
                             "--answer-len", "12", "--set", "actor.max_batch=4", "--set",
                             "sampling.max_new_tokens=4", "--json"],
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    e = d // heads
    per_layer = (d * heads * e + heads * e) + 2 * (d * kv * e + kv * e) + heads * e * d \
        + 3 * d * ff + 2 * d
    params = vocab * d + layers * per_layer + d  # tied: the embedding is the LM head
    assert out["params"] == params
    row = out["variants"]["float32/none"]
    assert row["model_gflop_per_token"] == pytest.approx(
        (6 * params + 12 * layers * heads * e * 32) / 1e9, rel=1e-12)
    assert row["mfu"] == pytest.approx(row["tokens_per_s"] * row["model_gflop_per_token"] / 2e3,
                                       rel=1e-9)
