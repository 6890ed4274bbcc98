"""LoRA adapters: applied on the fly they equal the merged weights (against a float64 reference);
a fresh adapter is the identity; exported in PEFT's format they load in `peft` over the
transformers base with headrace's logits, and merged they load in transformers alone; adapter
key and shape checks; `model.lora` validation names the key."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from headrace.config import ConfigError
from headrace.config import load as load_config
from headrace.model import lora
from headrace.model import params as params_lib
from headrace.model.load import load
from headrace.model.transformer import ModelDims, forward, segment_mask
from headrace.runtime.export import export_adapter, export_params
from tests.model import checkpoints as ck
from tests.model.test_checkpoints import _tokens

DIMS = ModelDims(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
ALL = lora.TARGETS.keys()
# headrace vs transformers in float32 on these tiny models: the bound the import tests use
# (tests/model/test_export.py), a few hundred float32 ulps of logits of size ~3.
HF_TOL = 1e-4


def _random_adapters(base, spec: lora.LoraSpec, seed: int) -> dict:
    """Adapters with B away from zero too (a trained adapter), so every term shows."""
    tree = lora.init(base, spec, seed)
    keys = iter(jax.random.split(jax.random.key(seed + 1), 256))
    return jax.tree.map(lambda x: x + 0.2 * jax.random.normal(next(keys), x.shape, x.dtype),
                        tree)


def _logits(dims, params, tokens, adapters=None, scale=1.0) -> np.ndarray:
    b, t = tokens.shape
    positions = np.broadcast_to(np.arange(t), (b, t))
    mask = segment_mask(np.ones((b, t), np.int32))
    out, _ = jax.jit(lambda p, a: forward(dims, p, jnp.asarray(tokens), positions, mask,
                                          adapters=a, lora_scale=scale))(params, adapters)
    return np.asarray(out, np.float64)


def test_a_fresh_adapter_leaves_the_model_exactly_as_it_was():
    _, base = params_lib.init(DIMS, 0)
    spec = lora.LoraSpec(4, 8.0, tuple(ALL))
    tokens = np.random.default_rng(0).integers(0, DIMS.vocab_size, (2, 10))
    np.testing.assert_array_equal(_logits(DIMS, base, tokens, lora.init(base, spec, 1), 2.0),
                                  _logits(DIMS, base, tokens))


def test_adapters_on_the_fly_equal_merged_weights_and_a_float64_merge():
    _, base = params_lib.init(DIMS, 0)
    spec = lora.LoraSpec(4, 8.0, ("q", "v", "o", "down"))
    adapters = _random_adapters(base, spec, 2)
    tokens = np.random.default_rng(1).integers(0, DIMS.vocab_size, (2, 10))
    on_the_fly = _logits(DIMS, base, tokens, adapters, spec.scale)
    merged = lora.merge(base, adapters, spec)
    # The merge itself against float64 numpy: one float32 rounding of W + s * A @ B (r = 4 terms).
    flat_base, flat_ad = params_lib.flatten(base), params_lib.flatten(adapters)
    for key, w in params_lib.flatten(merged).items():
        path = key.removesuffix(".kernel")
        if f"{path}.lora_a" not in flat_ad:
            assert w is flat_base[key]  # untouched leaves are shared, not copied
            continue
        a, b = (np.asarray(flat_ad[f"{path}.{x}"], np.float64) for x in ("lora_a", "lora_b"))
        exact = np.asarray(flat_base[key], np.float64) + spec.scale * a @ b
        np.testing.assert_allclose(np.asarray(w, np.float64), exact, rtol=0,
                                   atol=4 * np.finfo(np.float32).eps * np.abs(exact).max())
    # x W + s (x A) B vs x (W + s A B): the same sums in another order; a float32 reassociation
    # over d = 32..64 terms per matmul, two layers: well under the 1e-4 import bound.
    assert np.abs(on_the_fly - _logits(DIMS, merged, tokens)).max() <= HF_TOL
    assert np.abs(on_the_fly - _logits(DIMS, base, tokens)).max() > 100 * HF_TOL  # it matters


def test_the_merger_checks_keys_and_shapes():
    _, base = params_lib.init(DIMS, 0)
    spec = lora.LoraSpec(2, 4.0, ("q", "up"))
    merger = lora.Merger(base, spec)
    flat = params_lib.to_host(lora.init(base, spec, 0))
    assert set(flat) == set(merger.expected) and lora.is_adapters(flat)
    merged = merger(flat)
    np.testing.assert_array_equal(np.asarray(merged["layers"][0]["attn"]["q"]["kernel"]),
                                  np.asarray(base["layers"][0]["attn"]["q"]["kernel"]))
    with pytest.raises(lora.AdapterError, match="full weights"):
        merger(params_lib.to_host(base))
    with pytest.raises(lora.AdapterError, match="keys differ"):
        merger({k: v for k, v in flat.items() if ".up." not in k})
    wrong = dict(flat, **{"layers.0.attn.q.lora_a": np.zeros((DIMS.d_model, 3), np.float32)})
    with pytest.raises(lora.AdapterError, match="shape"):
        merger(wrong)


@pytest.mark.parametrize("bad,words", [
    ({"rank": -1}, "model.lora.rank"), ({"alpha": 0}, "model.lora.alpha"),
    ({"targets": ["q", "qkv"]}, "model.lora.targets"), ({"targets": []}, "model.lora.targets"),
    ({"targets": ["q", "q"]}, "twice"), ({"ranks": 2}, "model.lora.ranks: unknown key")])
def test_model_lora_validation_names_the_key(bad, words):
    with pytest.raises(ConfigError, match=words):
        load_config(data={"model": {"lora": {"rank": 4, **bad}}})


def test_lora_with_a_sharded_learner_is_refused_with_the_way_out():
    with pytest.raises(ConfigError, match="model.lora.rank.*parallel.mesh"):
        load_config(data={"model": {"lora": {"rank": 4}},
                          "parallel": {"mesh": {"data": 2, "fsdp": 1, "tensor": 1}}})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama2", "smollm2", "qwen2"])
def test_a_peft_adapter_loads_with_headrace_logits_and_merged_weights_too(family, tmp_path):
    """transformers + peft on the exported adapter give headrace's logits (on the fly) within
    the float32 import bound; the merged export loads in transformers alone the same."""
    pytest.importorskip("peft")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    source = ck.make(family, tmp_path / "base", seed=4)
    model = load(f"hf:{source}")
    spec = lora.LoraSpec(4, 8.0, tuple(ALL))
    adapters = _random_adapters(model.params, spec, 5)
    tokens = _tokens(seed=6)
    ours = _logits(model.dims, model.params, tokens, adapters, spec.scale)

    out = export_adapter(model.dims, adapters, spec, tmp_path / "adapter", str(source))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, out)
    peft_model.eval()
    with torch.no_grad():
        theirs = peft_model(torch.as_tensor(tokens, dtype=torch.long)).logits.double().numpy()
    assert np.abs(theirs - ours).max() <= HF_TOL
    assert np.abs(ck.reference_logits(source, tokens) - ours).max() > 100 * HF_TOL

    merged = export_params(model.dims, lora.merge(model.params, adapters, spec),
                           tmp_path / "merged", family=ck.FAMILIES[family][0])
    assert np.abs(ck.reference_logits(merged, tokens) - ours).max() <= HF_TOL
