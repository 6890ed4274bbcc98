"""The tree stays clean under the project's ruff configuration (pyproject.toml)."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).parent / "ruff")
    if not pathlib.Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e .[test])")
    result = subprocess.run([ruff, "check", "headrace", "tests"], cwd=ROOT,
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stdout[-4000:]
