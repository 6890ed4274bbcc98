"""Checkpoints out: import -> export -> transformers load gives identical logits for every family;
a trained run's checkpoint exports (as llama) and loads; `headrace generate` and `headrace export`
through the real command line."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import numpy as np
import pytest

from headrace.config import ConfigError
from headrace.config import load as load_config
from headrace.model.load import load
from headrace.runtime.export import export_params, export_run
from tests.model import checkpoints as ck
from tests.model.test_checkpoints import _logits, _tokens

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

FAMILY_OF = {name: model_type for name, (model_type, _) in ck.FAMILIES.items()}


@pytest.mark.parametrize("family", list(ck.FAMILIES))
def test_import_export_round_trip_gives_identical_logits(family, tmp_path):
    source = ck.make(family, tmp_path / "in", seed=3)
    model = load(f"hf:{source}")
    out = export_params(model.dims, model.params, tmp_path / "out", family=FAMILY_OF[family])
    tokens = _tokens(seed=5)
    # Same weights, same code: the reference's logits on the exported folder are its logits on the
    # source folder, bit for bit.
    np.testing.assert_array_equal(ck.reference_logits(out, tokens),
                                  ck.reference_logits(source, tokens))
    assert np.abs(_logits(load(f"hf:{out}"), tokens) - ck.reference_logits(out, tokens)).max() \
        <= 1e-4
    if model.dims.tie_embeddings:  # vLLM reads an aliased lm_head as zeros: store the embedding
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "numpy") as f:
            assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()


def test_bfloat16_export_loads_in_transformers(tmp_path):
    source = ck.make("qwen2", tmp_path / "in")
    model = load(f"hf:{source}")
    out = export_params(model.dims, model.params, tmp_path / "out", family="qwen2",
                        dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    tokens = _tokens()
    delta = np.abs(ck.reference_logits(out, tokens, "bfloat16")
                   - ck.reference_logits(source, tokens)).max()
    assert delta <= 2e-2


def test_a_model_a_family_cannot_express_is_refused(tmp_path):
    model = load(f"hf:{ck.make('qwen3', tmp_path / 'in')}")
    with pytest.raises(ConfigError, match="qk_norm"):
        export_params(model.dims, model.params, tmp_path / "out", family="llama")


SFT = {
    "run": {"seed": 0, "log_every": 5, "launcher": "threads", "eval_every": 0},
    "env": {"name": "tool_calculator", "kwargs": {"digits": 1, "terms": 2, "ops": "+",
                                                  "max_turns": 3}},
    "text": {"template": "chat", "observation_role": "tool"},
    "model": {"preset": "tiny", "max_len": 64},
    "sampling": {"max_new_tokens": 12},
    "actor": {"envs_per_actor": 16, "group_size": 4, "max_batch": 16},
    "shapes": {"buckets": [32, 64]},
    "sft": {"episodes": 8, "steps": 3, "batch_size": 4, "lr": 3.0e-3, "eval_every": 0,
            "eval_episodes": 4},
}


def test_a_trained_run_exports_as_llama_and_loads_with_the_same_logits(tmp_path):
    from headrace.runtime import sft
    from headrace.runtime.generate import open_model

    data = copy.deepcopy(SFT)
    data["sft"]["dir"] = str(tmp_path / "run")
    sft.run(load_config(data=data), echo=False)
    summary = export_run(tmp_path / "run" / "checkpoints" / "3", tmp_path / "hf")
    assert summary["family"] == "llama" and summary["step"] == 3
    dims, params, _, _ = open_model(str(tmp_path / "run"))
    tokens = np.random.default_rng(0).integers(0, dims.vocab_size, (2, 10))

    class Model:  # what _logits reads
        pass

    ours = Model()
    ours.dims, ours.params = dims, params
    delta = np.abs(_logits(ours, tokens) - ck.reference_logits(tmp_path / "hf", tokens)).max()
    assert delta <= 1e-4
    with pytest.raises(ConfigError, match="no checkpoint 7"):
        export_run(tmp_path / "run" / "checkpoints" / "7", tmp_path / "hf2")
    with pytest.raises(ConfigError, match="not a run folder"):
        export_run(tmp_path, tmp_path / "hf3")


def _cli(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "headrace.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_generate_command_line_prints_the_greedy_tokens_as_json(tmp_path):
    from headrace.model.generate import generate

    folder = ck.make("llama3", tmp_path / "m")
    done = _cli("generate", f"hf:{folder}", "--prompt-ids", "5,17,42", "--max-new-tokens", "8",
                "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    model = load(f"hf:{folder}")
    want = generate(model.dims, model.params, [5, 17, 42], max_new_tokens=8).tokens
    assert out == {"tokens": [int(t) for t in want], "text": None}
    bad = _cli("generate", f"hf:{folder}", "--prompt-ids", "5,x")
    assert bad.returncode == 2 and "comma-separated integers" in bad.stderr
    bad = _cli("generate", f"hf:{folder}", "--prompt", "hi")
    assert bad.returncode == 2 and "no tokenizer" in bad.stderr and "Traceback" not in bad.stderr


def test_the_base_of_a_run_from_a_checkpoint_exports_as_its_family(tmp_path):
    """A run that started from `hf:DIR` exports as that checkpoint's family (its config read
    back through the checkpoint loader), with transformers' logits of the source checkpoint."""
    from headrace.runtime.export import export_run_base

    ck.make("qwen2", tmp_path / "source")
    source = load_config(data={"env": {"name": "guess_number"}, "run": {"launcher": "threads"},
                               "model": {"init_from": f"hf:{tmp_path / 'source'}"}})
    dims = load(source.model.init_from).dims
    assert export_run_base(source, dims, tmp_path / "out", "float32") == {"family": "qwen2"}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen2"
    tokens = _tokens()
    delta = np.abs(ck.reference_logits(tmp_path / "out", tokens)
                   - ck.reference_logits(tmp_path / "source", tokens)).max()
    assert delta <= 1e-5  # the same float32 weights through the same transformers model
