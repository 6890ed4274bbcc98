"""The GGUF reader and its embedded tokenizer against transformers' own GGUF loading of the
packaged SmolLM2-135M-Instruct (the reference: `from_pretrained(dir, gguf_file=...)`)."""

from __future__ import annotations

import unicodedata

import numpy as np
import pytest

from headrace.formats import gguf
from headrace.text.hf_tokenizer import HFTokenizer, gguf_tokenizer
from tests.text.strings import corpus


@pytest.fixture
def checkpoint(smollm2_checkpoint):
    return smollm2_checkpoint


@pytest.fixture
def hf_tokenizer(smollm2_reference):
    return smollm2_reference


def assert_config_equal(config, reference):
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps",
                "vocab_size", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                "eos_token_id", "pad_token_id", "hidden_act", "attention_bias", "mlp_bias"):
        assert config[key] == reference[key], key
    assert config["rope_theta"] == reference["rope_parameters"]["rope_theta"] == 1e5
    assert config["rope_parameters"] == reference["rope_parameters"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)


def test_config_and_every_tensor_equal_transformers(checkpoint, smollm2_path):
    """The config, and every tensor against transformers' GGUF loading (`load_gguf_checkpoint`,
    what `from_pretrained(gguf_file=)` calls; `from_pretrained` itself also wants `accelerate`)
    into a LlamaForCausalLM on the meta device. Q4_1 / Q8_0 dequantize as d*q (+ m) from fp16
    scales: the products are exact in float32 and one rounding remains, so two correct
    dequantizers agree bit for bit."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = smollm2_path
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert_config_equal(checkpoint.config, config.to_dict())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    reference = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    assert checkpoint.config["tie_word_embeddings"] and "lm_head.weight" not in checkpoint.tensors
    assert set(checkpoint.tensors) == set(reference)
    assert set(reference) | {"lm_head.weight"} == set(model.state_dict())
    for name in checkpoint.tensors:  # one tensor at a time
        ours, theirs = checkpoint.tensors[name], reference[name].float().numpy()
        assert ours.dtype == np.float32 and ours.shape == theirs.shape, name
        assert checkpoint.tensors.shape(name) == ours.shape
        np.testing.assert_array_equal(ours, theirs, err_msg=name)
    assert checkpoint.tensors.quantization("model.layers.0.self_attn.q_proj.weight") == "Q4_1"


def test_rope_unpermutation_is_llama_cpp_inverse():
    """llama.cpp's convert script permutes with reshape(h, 2, rows/h/2, in).swapaxes(1, 2)."""
    rng = np.random.default_rng(0)
    heads, head_dim, d = 3, 8, 5
    w = rng.normal(size=(heads * head_dim, d))
    permuted = w.reshape(heads, 2, head_dim // 2, d).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(gguf.unpermute_rope_rows(permuted, heads), w)
    b = rng.normal(size=heads * head_dim)
    permuted_b = b.reshape(heads, 2, head_dim // 2).swapaxes(1, 2).reshape(b.shape)
    np.testing.assert_array_equal(gguf.unpermute_rope_rows(permuted_b, heads), b)


def test_tokenizer_ids_equal_transformers(checkpoint, hf_tokenizer):
    """Ids equal to transformers' on 1,000 strings.

    One known difference: transformers' GGUF conversion gives the `smollm` pre-tokenizer GPT-2's
    regex alone, while SmolLM2's own tokenizer.json (and llama.cpp's `smollm` pre-tokenizer) first
    isolate every digit; so a run of whitespace or punctuation before a digit splits differently
    there ("    0": transformers-GGUF "ĠĠĠ" "Ġ" "0", the model's tokenizer "ĠĠĠĠ" "0"). We follow the
    model: ids equal transformers' on every string without a number character, and on every string once
    transformers' tokenizer is given SmolLM2's pre-tokenizer.
    """
    from tokenizers import pre_tokenizers

    ours = gguf_tokenizer(checkpoint)
    assert isinstance(ours, HFTokenizer)
    strings = corpus(1000)
    reference = [hf_tokenizer(s, add_special_tokens=False)["input_ids"] for s in strings]
    mine = ours.encode_batch(strings, markup=True)
    digitless = [i for i, s in enumerate(strings)  # no number character (\p{N}: also "Ⅻ")
                 if not any(unicodedata.category(c)[0] == "N" for c in s)]
    assert len(digitless) > 300
    assert [mine[i] for i in digitless] == [reference[i] for i in digitless]
    assert [ours.encode_markup(s).tolist() for s in strings[:50]] == mine[:50]
    hf_tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])  # SmolLM2's tokenizer.json
    reference = [hf_tokenizer(s, add_special_tokens=False)["input_ids"] for s in strings]
    assert mine == reference
    split = [hf_tokenizer(s, add_special_tokens=False, split_special_tokens=True)["input_ids"]
             for s in strings]
    assert ours.encode_batch(strings) == split  # encode: special strings stay text
    assert ours.encode("<|im_end|>").tolist() != [ours.special_id("<|im_end|>")]
    for ids in reference[:200]:
        assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
        assert ours.decode_markup(ids) == hf_tokenizer.decode(ids, skip_special_tokens=False)
    assert sum(map(len, reference)) > 20_000  # the corpus is not trivially short


def test_tokenizer_specials_equal_transformers(checkpoint, hf_tokenizer):
    ours = gguf_tokenizer(checkpoint)
    assert ours.vocab_size == len(hf_tokenizer) == 49152
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (hf_tokenizer.bos_token_id,
                                                     hf_tokenizer.eos_token_id,
                                                     hf_tokenizer.pad_token_id)
    reference = {t.content: i for i, t in hf_tokenizer.added_tokens_decoder.items() if t.special}
    assert ours.specials == reference
    assert ours.chat_template == hf_tokenizer.chat_template == checkpoint.chat_template


def test_unsupported_files_are_named(tmp_path):
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"definitely not gguf")
    with pytest.raises(gguf.GGUFError, match="not a readable GGUF"):
        gguf.read(bad)
    with pytest.raises(gguf.GGUFError, match="no such GGUF file"):
        gguf.read(tmp_path / "missing.gguf")
    with pytest.raises(gguf.GGUFError, match="no installed package 'no_such_pkg_xyz'"):
        gguf.read("pkg:no_such_pkg_xyz/model.gguf")


def test_other_architecture_is_one_clear_error(tmp_path):
    writer_mod = pytest.importorskip("gguf")
    path = tmp_path / "qwen.gguf"
    writer = writer_mod.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(gguf.GGUFError, match="architecture 'qwen2' is not supported"):
        gguf.read(path)
