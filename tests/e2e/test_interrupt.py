"""Ctrl-C stops every thread cleanly and still writes the final summary."""

import json
import subprocess
import sys
import time

import pytest


@pytest.mark.timeout(300)
def test_sigint_writes_summary(tmp_path, interrupt):
    process = subprocess.Popen(
        [sys.executable, "-m", "headrace.cli", "train", "examples/guess_number.yaml", "--json",
         "--set", f"run.dir={tmp_path}/run", "--set", "run.max_wall_s=0",
         "--set", "actor.envs_per_actor=64", "--set", "learner.groups_per_batch=8",
         "--set", "buffer.capacity=8"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:  # wait until it is training
            if metrics.exists() and any(json.loads(line)["step"] > 0
                                        for line in metrics.read_text().splitlines()):
                break
            time.sleep(0.5)
        stdout, stderr = interrupt(process, 90, "headrace train")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr[-3000:]
    summary = json.loads(stdout)
    assert summary["stopped_by"] == "interrupted"
    assert summary["steps"] > 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["stopped_by"] == "interrupted"
