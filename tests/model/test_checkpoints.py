"""Real checkpoint formats: every family's logits and greedy continuation against transformers on
tiny random checkpoints it makes offline, the same logits on a (2, 2, 2) mesh, sharded
safetensors, and one clear error per unsupported thing."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from headrace.config import ConfigError
from headrace.config import load as load_config
from headrace.formats import hf
from headrace.model.dims import read_dims
from headrace.model.generate import generate
from headrace.model.load import CheckpointError, load
from headrace.model.transformer import forward, segment_mask
from tests.model import checkpoints as ck

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)
FP32_TOL = 1e-4  # the bound; measured max |delta| is ~3e-7 (fp32 rounding)
BF16_TOL = 2e-2


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """family -> checkpoint folder (made once per module)."""
    root = tmp_path_factory.mktemp("families")
    return {family: ck.make(family, root / family) for family in ck.FAMILIES}


def _tokens(seed: int = 0, rows: int = 2, width: int = 12) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, ck.VOCAB, (rows, width))


def _logits(model, tokens: np.ndarray) -> np.ndarray:
    b, t = tokens.shape
    positions = np.broadcast_to(np.arange(t), (b, t))
    mask = segment_mask(np.ones((b, t), np.int32))
    logits, _ = jax.jit(lambda p, x: forward(model.dims, p, x, positions, mask))(
        model.params, tokens)
    return np.asarray(logits, np.float64)


def _hf_greedy(folder, prompt: np.ndarray, steps: int):
    """transformers' greedy tokens and, per step, its logits' top-2 gap."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.as_tensor(prompt[None], dtype=torch.long)
    tokens, gaps = [], []
    with torch.no_grad():
        for _ in range(steps):  # full recompute per step: no cache differences to argue about
            logits = model(ids).logits[0, -1].double().numpy()
            top2 = np.sort(logits)[-2:]
            tokens.append(int(np.argmax(logits)))
            gaps.append(float(top2[1] - top2[0]))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens, gaps


@pytest.mark.parametrize("family", list(ck.FAMILIES))
def test_logits_and_greedy_continuation_match_transformers(made, family):
    folder = made[family]
    model = load(f"hf:{folder}")
    tokens = _tokens(seed=len(family))
    delta = np.abs(_logits(model, tokens) - ck.reference_logits(folder, tokens)).max()
    assert delta <= FP32_TOL, f"{family}: max |delta logit| {delta}"
    prompt = tokens[0, :6]
    ours = generate(model.dims, model.params, prompt, max_new_tokens=32, temperature=0).tokens
    theirs, gaps = _hf_greedy(folder, prompt, 32)
    assert len(ours) == 32
    for step, (a, b, gap) in enumerate(zip(ours, theirs, gaps)):
        if a != b:  # only a near tie may go either way; after it the continuations differ
            assert gap <= 10 * max(delta, 1e-7), f"{family}: step {step} differs, gap {gap}"
            break


@pytest.mark.parametrize("family", ["llama3", "gemma2"])
def test_bfloat16_logits_within_bound(made, family, tmp_path):
    folder = ck.make(family, tmp_path / family, dtype="bfloat16")
    tokens = _tokens()
    ours = _logits(load(f"hf:{folder}", dtype="bfloat16"), tokens)
    delta = np.abs(ours - ck.reference_logits(folder, tokens, "bfloat16")).max()
    assert delta <= BF16_TOL, f"{family}: bf16 max |delta logit| {delta}"


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "llama3"])
def test_sharded_logits_equal_single_device(made, family):
    from headrace.learner.sharded_forward import ShardedForward, ShardedLayout
    from headrace.parallel import rules
    from headrace.parallel.mesh import ROW_AXES, make_mesh

    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    single = load(f"hf:{made[family]}")
    plan = rules.plan_params(single.params, mesh)
    shardings = {path: NamedSharding(mesh, item.spec) for path, item in plan.items()}
    sharded = load(f"hf:{made[family]}", shardings=shardings)
    for path in plan:  # each parameter landed on its own sharding
        leaf = sharded.params
        for key in path.split("."):
            leaf = leaf[int(key) if key.isdigit() else key]
        assert leaf.sharding.is_equivalent_to(shardings[path], leaf.ndim), path
    specs = rules.specs_like(sharded.params, plan)
    layout = ShardedLayout.for_model(single.dims, 2, {p: i.spec for p, i in plan.items()})
    fwd = ShardedForward(single.dims, layout)
    tokens = _tokens(rows=4)
    positions = np.broadcast_to(np.arange(12), (4, 12)).astype(np.int32)
    segments = np.ones((4, 12), np.int32)
    rows = jax.sharding.PartitionSpec(ROW_AXES, None)
    vocab = jax.sharding.PartitionSpec(ROW_AXES, None, "tensor" if layout.vocab else None)
    logits = jax.jit(jax.shard_map(fwd.logits, mesh=mesh, in_specs=(specs, rows, rows, rows),
                                   out_specs=vocab))(sharded.params, tokens, positions, segments)
    np.testing.assert_allclose(np.asarray(logits), _logits(single, tokens), atol=1e-5, rtol=1e-5)


def test_sharded_safetensors_index_loads_the_same(made, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(made["qwen3"], dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / hf.INDEX).is_file()
    tokens = _tokens()
    np.testing.assert_array_equal(_logits(load(f"hf:{tmp_path / 'sharded'}"), tokens),
                                  _logits(load(f"hf:{made['qwen3']}"), tokens))


def _edited(folder, tmp_path, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    out = tmp_path / "edited"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors").symlink_to(folder / "model.safetensors")
    return out


@pytest.mark.parametrize("changes, words", [
    (dict(model_type="phi3"), "model_type 'phi3' is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
     "rope_type 'yarn' is not implemented"),
    (dict(attention_bias=True), "attention_bias=true is not implemented for llama"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(num_hidden_layers=3), "model.layers.2.input_layernorm.weight"),
    (dict(intermediate_size=48), "has shape (64, 32), the config implies (48, 32)"),
])
def test_unsupported_or_inconsistent_checkpoints_fail_naming_the_cause(made, tmp_path, changes,
                                                                       words):
    folder = _edited(made["llama2"], tmp_path, **changes)
    with pytest.raises(CheckpointError, match=None) as error:
        load(f"hf:{folder}")
    assert words in str(error.value)


def test_a_checkpoint_sets_dims_and_sizes_set_beside_it_are_refused(made):
    spec = f"hf:{made['gemma3']}"
    dims = read_dims(spec)
    assert (dims.d_model, dims.n_layers, dims.head_dim, dims.vocab_size) == (32, 2, 16, ck.VOCAB)
    assert load_config(data={"model": {"init_from": spec}}).model.init_from == spec
    with pytest.raises(ConfigError, match="model.d_model"):
        load_config(data={"model": {"init_from": spec, "d_model": 128}})
    with pytest.raises(ConfigError, match="no such folder"):
        load(f"hf:{made['gemma3']}-missing")


def test_warm_start_from_a_checkpoint_places_parameters_on_the_learners_mesh(made):
    from headrace.model.dims import ModelDims
    from headrace.parallel import rules
    from headrace.parallel.mesh import make_mesh
    from headrace.sft import load_init_params

    spec = f"hf:{made['qwen2']}"
    config = load_config(data={"model": {"init_from": spec},
                               "parallel": {"mesh": {"data": 2, "fsdp": 2, "tensor": 2}}})
    dims = ModelDims.from_config(config.model, 0)
    _, params = load_init_params(config, dims)
    plan = rules.plan_params(params, make_mesh(config.parallel.mesh))
    leaf = params["layers"][0]["attn"]["q"]["kernel"]
    assert leaf.sharding.spec == plan["layers.0.attn.q.kernel"].spec
    assert len({s.device for s in leaf.addressable_shards}) == 8
    single = load(spec).params
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(single)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_gguf_file_loads_with_transformers_logits(tmp_path):
    """A tiny llama GGUF (written with llama.cpp's Q/K permutation, untied head, rope θ 5e5)
    against transformers running the same Hugging Face tensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.text import test_gguf_synthetic as synthetic

    rng = np.random.default_rng(0)
    tensors = {k: v for k, v in synthetic.hf_tensors(rng).items() if not k.endswith("bias")}
    path = synthetic.write(tmp_path / "tiny.gguf", tensors)
    model = load(f"gguf:{path}")
    assert model.chat_template and model.tokenizer is not None and model.max_len == 64
    config = {k: v for k, v in model.config.items() if k not in ("rope_theta", "unk_token_id")}
    reference = LlamaForCausalLM(LlamaConfig(**config)).eval()
    reference.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()})
    tokens = np.random.default_rng(1).integers(0, len(synthetic.TOKENS), (2, 10))
    with torch.no_grad():
        want = reference(torch.as_tensor(tokens)).logits.double().numpy()
    assert np.abs(_logits(model, tokens) - want).max() <= FP32_TOL
