"""The GGUF reader on tiny llama files written here with `gguf.GGUFWriter` (no package needed):
tensors permuted exactly as llama.cpp's converter permutes them come back as Hugging Face holds
them; the config, the tokenizer and every unsupported feature are checked by name."""

from __future__ import annotations

import numpy as np
import pytest

from headrace.formats import gguf
from headrace.text.hf_tokenizer import gguf_tokenizer

gguf_lib = pytest.importorskip("gguf")

HEADS, KV_HEADS, HEAD_DIM, D, FFN = 2, 1, 4, 8, 12
TOKENS = ["<|endoftext|>", "a", "b", "ab", "Ġ", "Ġa", "<|im_start|>", "<|im_end|>", "1"]
TYPES = [3, 1, 1, 1, 1, 1, 3, 3, 1]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def hf_tensors(rng) -> dict[str, np.ndarray]:
    p = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (len(TOKENS), D), "lm_head.weight": (len(TOKENS), D),
              "model.norm.weight": (D,), p + "input_layernorm.weight": (D,),
              p + "post_attention_layernorm.weight": (D,),
              p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, D),
              p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, D),
              p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, D),
              p + "self_attn.q_proj.bias": (HEADS * HEAD_DIM,),
              p + "self_attn.k_proj.bias": (KV_HEADS * HEAD_DIM,),
              p + "self_attn.v_proj.bias": (KV_HEADS * HEAD_DIM,),
              p + "self_attn.o_proj.weight": (D, HEADS * HEAD_DIM),
              p + "mlp.gate_proj.weight": (FFN, D), p + "mlp.up_proj.weight": (FFN, D),
              p + "mlp.down_proj.weight": (D, FFN)}
    return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
              "model.norm.weight": "output_norm.weight"}
LAYER = {"input_layernorm.weight": "attn_norm.weight",
         "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
         "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
         "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
         "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def write(path, tensors, extra=None, rope_dims=HEAD_DIM, tokenizer_model="gpt2", pre="smollm",
          template="{{ messages[0].content }}"):
    """A tiny llama GGUF of `tensors` (HF names and layout), Q/K permuted as llama.cpp does."""
    writer = gguf_lib.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(5e5)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(rope_dims)
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TOKENS)
    writer.add_token_types(TYPES)
    writer.add_token_merges(["a b", "Ġ a"])
    writer.add_bos_token_id(6)
    writer.add_eos_token_id(7)
    writer.add_chat_template(template)
    for key, value in (extra or {}).items():
        getattr(writer, key)(value)
    for name, w in tensors.items():
        if name.startswith("model.layers.0."):
            short = name[len("model.layers.0."):]
            gname = "blk.0." + LAYER[short]
            heads = HEADS if "q_proj" in short else KV_HEADS if "k_proj" in short else None
            w = llama_cpp_permute(w, heads) if heads else w
        else:
            gname = GGUF_NAMES.get(name, name)
        writer.add_tensor(gname, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tensors_come_back_as_hugging_face_holds_them(tmp_path):
    tensors = hf_tensors(np.random.default_rng(0))
    checkpoint = gguf.read(write(tmp_path / "tiny.gguf", tensors))
    assert set(checkpoint.tensors) == set(tensors)
    for name, w in tensors.items():
        np.testing.assert_array_equal(checkpoint.tensors[name], w, err_msg=name)
    config = checkpoint.config
    assert config["tie_word_embeddings"] is False and config["attention_bias"] is True
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == \
        (HEADS, KV_HEADS, HEAD_DIM)
    assert config["rope_theta"] == 5e5 and config["max_position_embeddings"] == 64
    assert (config["bos_token_id"], config["eos_token_id"]) == (6, 7)
    assert checkpoint.chat_template == "{{ messages[0].content }}"


def test_embedded_tokenizer(tmp_path):
    checkpoint = gguf.read(write(tmp_path / "tiny.gguf", hf_tensors(np.random.default_rng(1))))
    tokenizer = gguf_tokenizer(checkpoint)
    assert tokenizer.encode("ab a").tolist() == [3, 5]
    assert tokenizer.encode_markup("a<|im_end|>").tolist() == [1, 7]
    assert tokenizer.encode("<|im_end|>").tolist() != [7]  # plain text, not the special
    assert tokenizer.specials == {"<|endoftext|>": 0, "<|im_start|>": 6, "<|im_end|>": 7}
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (6, 7, 7)
    assert tokenizer.decode([3, 5, 7]) == "ab a" and tokenizer.decode_markup([7]) == "<|im_end|>"
    assert tokenizer.encode("a11").tolist() == [1, 8, 8]  # digits isolated (smollm)


@pytest.mark.parametrize("options, tensor, match", [
    ({"extra": {"add_rope_scaling_type": gguf_lib.RopeScalingType.YARN}}, None, "rope scaling"),
    ({}, "rope_freqs.weight", "rope scaling"),
    ({"rope_dims": HEAD_DIM // 2}, None, "partial rotary"),
    ({}, "blk.0.attn_q_norm.weight", "tensor 'blk.0.attn_q_norm.weight' is not one"),
    ({"tokenizer_model": "llama"}, None, "tokenizer.ggml.model='llama' is not supported"),
    ({"pre": "deepseek-coder"}, None, "tokenizer.ggml.pre='deepseek-coder' is not supported"),
])
def test_unsupported_features_are_named(tmp_path, options, tensor, match):
    tensors = hf_tensors(np.random.default_rng(2))
    if tensor:
        tensors[tensor] = np.ones(HEAD_DIM // 2, np.float32)
    path = write(tmp_path / "x.gguf", tensors, **options)
    with pytest.raises(gguf.GGUFError, match=match):
        gguf_tokenizer(gguf.read(path))
