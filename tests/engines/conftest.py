"""The vLLM environment for tests/engines: present, or a clean skip.

Tests that need vLLM take the `vllm_python` fixture: the interpreter of `.venv-vllm` (made by
`scripts/vllm.sh setup`), or a skip saying how to make it. With HEADRACE_REQUIRE_VLLM=1 (what
`scripts/vllm.sh test` sets) a missing or broken environment fails instead of skipping.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from headrace.engines.vllm_server import DEFAULT_PYTHON


def _vllm_problem() -> str:
    if not DEFAULT_PYTHON.is_file():
        return f"no vLLM environment at {DEFAULT_PYTHON.parent.parent} (scripts/vllm.sh setup)"
    probe = subprocess.run([str(DEFAULT_PYTHON), "-c", "import vllm, headrace.engines.vllm_worker"],
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(DEFAULT_PYTHON.parents[2])})
    if probe.returncode:
        return f"{DEFAULT_PYTHON} cannot import vllm: {probe.stderr.strip()[-400:]}"
    return ""


@pytest.fixture(scope="session")
def vllm_python() -> str:
    problem = _vllm_problem()
    if problem:
        if os.environ.get("HEADRACE_REQUIRE_VLLM") == "1":
            pytest.fail(f"HEADRACE_REQUIRE_VLLM=1 but {problem}")
        pytest.skip(problem)
    return str(DEFAULT_PYTHON)
