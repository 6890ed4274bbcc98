"""`headrace bench NAME` from a wheel installed outside the checkout: the benchmarks and the example
configs ship in the package, and the command runs from any directory with nothing of the source
tree on its path."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
def test_a_wheel_runs_its_benchmarks_from_anywhere(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("headrace-*.whl")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
         str(wheel)], capture_output=True, text=True, timeout=120)
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert (site / "headrace" / "examples" / "guess_number.yaml").is_file()
    assert (site / "headrace" / "benchmarks" / "data" / "smollm2_lengths.txt").is_file()
    # The wheel's copy first on the path (the dependencies come from this environment), run in
    # an empty folder: nothing of the checkout is reachable.
    env = {**os.environ, "PYTHONPATH": str(site)}
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = subprocess.run([sys.executable, "-c", "import headrace; print(headrace.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert pathlib.Path(where.stdout.strip()).is_relative_to(site), where
    listed = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "nosuch"], cwd=work,
                            env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 2 and "bare" in listed.stderr and "utilization" in listed.stderr
    # The weights bench starts helper processes of its own module: they import the wheel too.
    done = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "weights", "--quick",
                           "--json"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["checks_passed"] is True, result
