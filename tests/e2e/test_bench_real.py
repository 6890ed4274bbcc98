"""`headrace bench real --quick --json`: a 2-layer random Llama written by transformers, loaded
through `hf:`, trained a few async GRPO steps on the example's reasoning-gym task; what a broken
pipeline would fail: no tokens trained, weights that never reach the actors, no evaluation on
the held-out split, no interval, no PNG."""

import json
import pathlib
import subprocess
import sys

import pytest


@pytest.mark.timeout(900)
def test_quick_real_bench_trains_publishes_and_evaluates(tmp_path):
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "real", "--quick",
                             "--json", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=880)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    assert data["model"].startswith("hf:") and data["env"]["dataset"] == "chain_sum"
    assert data["errors"] == [] and data["steps"] >= 2, data
    assert data["learner_tokens_per_s"] > 0 and data["generated_tokens"] > 0, data
    assert data["sampler_tokens_per_s"] > 0
    # every episode fit the sampler's context and its bucket: all trained as they were played
    assert data["truncated_episodes"] == 0 and data["truncated_trajectories"] == 0, data
    assert data["versions_published"] >= 2 and data["versions_acted"] >= 1, data
    for key in ("base", "trained"):
        m = data[key]
        assert m["tasks"] == 32 and 0 <= m["successes"] <= 32
        low, high = m["ci95"]
        assert 0 <= low <= m["rate"] <= high <= 1 and high - low > 0.05, m
    assert data["base"]["all_held_out"]
    assert data["gain"] == data["trained"]["rate"] - data["base"]["rate"]
    png = pathlib.Path(data["png"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "result.json").read_text())["steps"] == data["steps"]


def test_binomial_interval_matches_the_beta_quantiles():

    from scipy.stats import beta

    from headrace.benchmarks import real
    low, high = real.binomial_interval(30, 256)
    assert abs(low - beta.ppf(0.025, 30, 227)) < 1e-9 and abs(high - beta.ppf(0.975, 31, 226)) < 1e-9
    assert real.binomial_interval(0, 256)[0] == 0.0 and real.binomial_interval(256, 256)[1] == 1.0


def test_the_example_as_shipped_passes_the_runtimes_checks():
    # --quick runs it with the threads launcher and in-memory buffer; these are the checks the
    # processes launcher and Redis buffer of the shipped file must pass.
    from headrace.config import load
    from headrace.runtime import build

    config = load(pathlib.Path(__file__).resolve().parents[2] / "examples" / "smollm2_reasoning.yaml")
    assert config.run.launcher == "processes" and config.buffer.backend == "redis"
    build.check_flow(config)
