"""A checkpoint folder's tokenizer (tokenizer.json + tokenizer_config.json + chat_template.jinja,
as transformers 5 saves them) against transformers' AutoTokenizer on the same folder."""

from __future__ import annotations

import json

import pytest

from headrace.text.hf_tokenizer import CheckpointTextError, folder_tokenizer
from tests.text.strings import corpus


@pytest.fixture
def folder(tmp_path, smollm2_reference):
    """SmolLM2's tokenizer saved as a Hugging Face folder by transformers itself."""
    smollm2_reference.save_pretrained(tmp_path / "smollm2")
    return tmp_path / "smollm2"


def test_folder_ids_equal_transformers(folder):
    transformers = pytest.importorskip("transformers")
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ours = folder_tokenizer(folder)
    strings = corpus(1000, seed=1)
    reference = [reference_tokenizer(s, add_special_tokens=False)["input_ids"] for s in strings]
    assert ours.encode_batch(strings, markup=True) == reference
    for ids in reference[:100]:
        assert ours.decode(ids) == reference_tokenizer.decode(ids, skip_special_tokens=True)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (reference_tokenizer.bos_token_id,
                                                     reference_tokenizer.eos_token_id,
                                                     reference_tokenizer.pad_token_id)
    assert ours.chat_template == reference_tokenizer.chat_template
    assert (folder / "chat_template.jinja").is_file()  # transformers 5 writes the template there


def test_template_in_tokenizer_config_and_named_lists(folder, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"},
                               {"name": "default", "template": "{{ messages[0].content }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert folder_tokenizer(tmp_path).chat_template == "{{ messages[0].content }}"
    config["chat_template"] = [{"name": "tool_use", "template": "T"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointTextError, match="none named 'default'"):
        folder_tokenizer(tmp_path)


def test_missing_or_broken_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointTextError, match="no tokenizer.json"):
        folder_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointTextError, match="cannot read it"):
        folder_tokenizer(tmp_path)


def test_text_and_formats_import_no_jax():
    import subprocess
    import sys

    code = ("import sys\n"
            "import headrace.formats.gguf, headrace.text.checkpoint, headrace.text.template\n"
            "import headrace.text.tools, headrace.text.jinja_render\n"
            "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'flax')))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
