"""Tiny random Hugging Face checkpoints, one per family, made offline with transformers (~1 s
each), and transformers' logits on them (the reference)."""

from __future__ import annotations

import pathlib

import numpy as np

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
               "rope_theta": 500000.0}
# family name -> (model_type, config fields beyond COMMON)
FAMILIES = {
    "llama2": ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "llama3": ("llama", dict(rope_parameters=LLAMA3_ROPE, rms_norm_eps=1e-5)),
    "smollm2": ("llama", dict(tie_word_embeddings=True, num_attention_heads=4,
                              num_key_value_heads=1,
                              rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    "mistral": ("mistral", dict(sliding_window=None)),
    "mistral_window": ("mistral", dict(sliding_window=5)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=16, tie_word_embeddings=False)),
    "gemma2": ("gemma2", dict(head_dim=16, query_pre_attn_scalar=12, sliding_window=5,
                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("gemma3_text", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=5,
                                   layer_types=["sliding_attention", "full_attention"],
                                   final_logit_softcapping=None,
                                   rope_parameters={
                                       "sliding_attention": {"rope_type": "default",
                                                             "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                          "rope_theta": 1000000.0}})),
}


def make(family: str, folder: pathlib.Path, seed: int = 0, dtype: str = "float32",
         **fields) -> pathlib.Path:
    """Saves a random `family` model (float32 weights unless `dtype`) into `folder`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = FAMILIES[family]
    config = AutoConfig.for_model(model_type, **{**COMMON, **extra, **fields})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from their init, so a wrong offset shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    return folder


def reference_logits(folder: pathlib.Path, tokens: np.ndarray, dtype: str = "float32"
                     ) -> np.ndarray:
    """transformers' logits [b, t, v] (float64 numpy) for token rows."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    model.eval()
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(tokens), dtype=torch.long))
    return out.logits.to(torch.float64).numpy()
