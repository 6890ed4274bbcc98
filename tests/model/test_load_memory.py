"""Loading never holds the checkpoint whole in host memory: peak resident growth while loading a
145 MB checkpoint stays under parameter bytes + largest tensor + 10 % (measured in a child
process: ~159 MB against a bound of ~194 MB)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.model import checkpoints as ck

pytest.importorskip("transformers")


@pytest.mark.timeout(300)
def test_peak_memory_while_loading_is_params_plus_one_tensor(tmp_path):
    folder = ck.make("llama2", tmp_path / "big", vocab_size=8192, hidden_size=768,
                     num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4,
                     intermediate_size=2048)
    done = subprocess.run([sys.executable, "-m", "tests.model.load_memory", str(folder)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    m = json.loads(done.stdout)
    bound = 1.10 * (m["param_bytes"] + m["largest"])
    assert m["peak_bytes"] <= bound, m
