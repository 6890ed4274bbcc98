"""A real `headrace train` over processes and the embedded Redis, with a user-given password:
the password is nowhere in the run folder, the run's own secrets are private, `--resume` needs
the password back (and refuses in one line without it), and stderr carries no fork warning."""

from __future__ import annotations

import json
import os
import pathlib
import stat
import subprocess
import sys

import pytest

from headrace.buffer.server import SECRETS_FILE
from tests.conftest import _require_redis

ROOT = pathlib.Path(__file__).resolve().parents[2]
PASSWORD = "user-given-Pa55word-8c1e2f"
SMALL = ["--set", "run.launcher=processes", "--set", "run.eval_every=0", "--set",
         "run.max_wall_s=0", "--set", "run.stop_at_target=false", "--set", "run.checkpoint_every=1",
         "--set", "actor.envs_per_actor=8", "--set", "actor.max_batch=8", "--set",
         "learner.groups_per_batch=1", "--set", "learner.minibatches=1"]


def _train(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "HEADRACE_REDIS_PASSWORD"}
    return subprocess.run([sys.executable, "-m", "headrace.cli", "train", "--json", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=200,
                          env={**environment, **(env or {})})


def _files_holding(run_dir: pathlib.Path, secret: str) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")
                  if p.is_file() and secret.encode() in p.read_bytes())


@pytest.mark.timeout(420)
def test_a_user_password_never_reaches_the_run_folder_and_resume_needs_it(tmp_path):
    _require_redis()
    run_dir = tmp_path / "run"
    first = _train("examples/guess_number.yaml", "--set", f"run.dir={run_dir}", *SMALL,
                   "--set", "run.max_steps=2", "--set", f"buffer.password={PASSWORD}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(first.stdout)["steps"] == 2
    assert "fork" not in first.stderr, first.stderr[-3000:]  # JAX's os.fork() warning
    assert _files_holding(run_dir, PASSWORD) == []
    secrets = run_dir / SECRETS_FILE
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
    admin = json.loads(secrets.read_text())["admin"]
    assert _files_holding(run_dir, admin) == [SECRETS_FILE]
    assert "password: ''" in (run_dir / "config.yaml").read_text()

    refused = _train("--resume", str(run_dir), "--set", "run.max_steps=4")
    assert refused.returncode == 2, refused.stderr[-3000:]
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "HEADRACE_REDIS_PASSWORD" in lines[0], refused.stderr[-3000:]
    assert len(json.loads((run_dir / "run.json").read_text())["resumes"]) == 0

    resumed = _train("--resume", str(run_dir), "--set", "run.max_steps=4",
                     env={"HEADRACE_REDIS_PASSWORD": PASSWORD})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout)
    assert summary["steps"] == 4 and summary["errors"] == [], summary
    assert "fork" not in resumed.stderr
    assert _files_holding(run_dir, PASSWORD) == []
    assert json.loads(secrets.read_text())["admin"] == admin  # the same run, the same secrets


@pytest.mark.timeout(420)
def test_a_run_over_a_unix_socket_opens_no_port_and_resumes(tmp_path):
    """`buffer.transport: unix`: the supervisor, the learner and two actor processes (and the
    metrics they publish) reach the run's Redis through its socket file; a resumed run's server
    listens there again."""
    _require_redis()
    run_dir = tmp_path / "run"
    first = _train("examples/guess_number.yaml", "--set", f"run.dir={run_dir}", *SMALL,
                   "--set", "run.max_steps=2", "--set", "buffer.transport=unix",
                   "--set", "actor.num_actors=2")
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout)
    assert summary["steps"] == 2 and summary["errors"] == [], summary
    conf = (run_dir / "redis" / "redis.conf").read_text().splitlines()
    assert "port 0" in conf and f'unixsocket "{run_dir / "redis" / "redis.sock"}"' in conf
    resumed = _train("--resume", str(run_dir), "--set", "run.max_steps=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout)
    assert summary["steps"] == 4 and summary["errors"] == [], summary
    assert not (run_dir / "redis" / "redis.sock").exists()  # the server is gone with the run
