"""`headrace.formats` (checkpoint reading, the name table) needs no JAX: a vLLM worker extension
or a converter can import it without one."""

import subprocess
import sys


def test_formats_import_without_jax():
    code = ("import sys, headrace.formats, headrace.formats.hf, headrace.formats.gguf; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
