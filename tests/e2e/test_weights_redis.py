"""guess_number trains with its weights in Redis (`weights.backend: redis`), through the real
command line: with the processes launcher every version goes through the run's embedded server as
its restricted client user (no weights directory); the threads launcher publishes to a
`weights.url` of its own; without any server the run stops with one line."""

import json
import subprocess
import sys

import pytest

from headrace.benchlib import LEARNED_SUCCESS_N8
from tests.e2e.test_train_cli import SMALL


@pytest.mark.timeout(600)
def test_guess_number_trains_with_weights_in_redis(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "headrace.cli", "train", "examples/guess_number.yaml", "--json",
         "--set", f"run.dir={run_dir}", "--set", "run.launcher=processes",
         "--set", "weights.backend=redis", "--set", "weights.chunk_mib=1", *SMALL],
        capture_output=True, text=True, timeout=580)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["steps"] == 150
    assert summary["final_success_rate"] >= LEARNED_SUCCESS_N8, summary
    assert not (run_dir / "weights").exists()  # nothing went through a shared filesystem
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["weights/publish_s_p50"] > 0 and record["weights/pickup_s_p50"] > 0
    # A version per step (publish_every 1); the last record precedes the last publish.
    assert record["learner/version"] >= summary["steps"] - 1
    # The versions went through the embedded server: its append-only file holds the pointer
    # (the weights' keys are namespaced by the run folder's name).
    pointer = f"headrace:weights:{run_dir.name}:latest".encode()
    assert any(pointer in path.read_bytes()
               for path in (run_dir / "redis").rglob("*.aof*") if path.is_file())


@pytest.mark.timeout(300)
def test_the_threads_launcher_publishes_to_weights_url(tmp_path, redis_server):
    """The threads launcher with the memory buffer and the weights in a Redis of their own."""
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "headrace.cli", "train", "examples/guess_number.yaml", "--json",
         "--set", f"run.dir={run_dir}", "--set", "run.launcher=threads",
         "--set", "weights.backend=redis", "--set", f"weights.url={redis_server.url}", *SMALL,
         "--set", "run.max_steps=5"],
        capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["steps"] == 5
    assert not (run_dir / "weights").exists()
    client = redis_server.client()
    try:  # version 0 and one per step, the last ones kept
        assert int(client.get(f"headrace:weights:{run_dir.name}:latest")) >= 4
    finally:
        client.close()


@pytest.mark.timeout(120)
def test_redis_weights_without_a_server_is_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "headrace.cli", "train", "examples/guess_number.yaml",
         "--set", f"run.dir={tmp_path}/run", "--set", "run.launcher=threads",
         "--set", "buffer.backend=memory", "--set", "weights.backend=redis",
         "--set", "run.max_steps=1"],
        capture_output=True, text=True, timeout=110)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "weights.url" in result.stderr and "buffer.backend: redis" in result.stderr


@pytest.mark.timeout(600)
def test_a_resumed_run_finds_its_weights_in_the_restarted_server(tmp_path):
    """`--resume` keeps the Redis store and finds the versions in the embedded server reloaded
    from its append-only file (a new port each time: config.yaml never records it)."""
    run_dir = tmp_path / "run"
    common = [sys.executable, "-m", "headrace.cli", "train", "--json"]
    first = subprocess.run(
        [*common, "examples/guess_number.yaml", "--set", f"run.dir={run_dir}",
         "--set", "run.launcher=processes", "--set", "weights.backend=redis", *SMALL,
         "--set", "run.max_steps=3", "--set", "run.checkpoint_every=3",
         "--set", "buffer.max_pending=128"],
        capture_output=True, text=True, timeout=280)
    assert first.returncode == 0, first.stderr[-3000:]
    for target in (5, 7):  # twice: the second resume reads the config the first one wrote
        again = subprocess.run([*common, "--resume", str(run_dir), "--set",
                                f"run.max_steps={target}"],
                               capture_output=True, text=True, timeout=280)
        assert again.returncode == 0, again.stderr[-3000:]
        assert json.loads(again.stdout)["steps"] == target
    config = (run_dir / "config.yaml").read_text()
    assert "backend: redis" in config.split("weights:")[1].split("\n\n")[0]
    assert "url: ''" in config.split("weights:")[1]
    assert not (run_dir / "weights").exists()
