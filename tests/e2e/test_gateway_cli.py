"""The gateway through the command line: `headrace serve` prints its base URL first and records
sessions; `headrace train examples/gateway_reasoning.yaml` trains through the example agent
(a tiny random checkpoint in place of SmolLM2, a few steps, the multi-process runtime)."""

import json
import pathlib
import signal
import subprocess
import sys

import httpx
import openai
import pytest
import yaml

from tests.gateway.helpers import tiny_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.mark.timeout(420)  # ~50 s on a quiet 2-core machine; minutes at load average 20
def test_serve_prints_its_url_first_and_records_sessions(tiny, tmp_path):
    record = tmp_path / "sessions.jsonl"
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "env": {"name": "gateway", "kwargs": {"tasks": {"name": "reasoning_gym", "kwargs": {
            "dataset": "chain_sum", "eval_size": 4}}}},
        "model": {"init_from": f"hf:{tiny}"}, "sampling": {"max_new_tokens": 4},
        "shapes": {"buckets": [256]}, "actor": {"max_batch": 4, "envs_per_actor": 4, "group_size": 2}}))
    server = subprocess.Popen([sys.executable, "-m", "headrace.cli", "serve", str(config),
                               "--port", "0", "--record", str(record)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), server.stderr.read()[-2000:]
        session = httpx.post(f"{url}/sessions", json={}, timeout=30).json()
        client = openai.OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0)
        client = client.with_options(timeout=300)
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1"}],
                                           extra_body={"return_token_ids": True})
        extra = r.model_extra["headrace"]
        done = httpx.post(f"{url}/sessions/{session['id']}/reward", json={"reward": 0.5})
        assert done.json() == {"id": session["id"], "reward": 0.5}
        for _ in range(100):  # written within a poll of the server's loop
            if record.exists() and record.read_text().strip():
                break
            __import__("time").sleep(0.1)
    finally:
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=120)
    assert server.returncode == 0, err[-2000:]
    (line,) = [json.loads(x) for x in record.read_text().splitlines()]
    (segment,) = line["segments"]
    assert segment["tokens"] == extra["prompt_token_ids"] + extra["token_ids"][0]
    assert segment["reward"] == 0.5 and sum(segment["loss_mask"]) == len(extra["token_ids"][0])


@pytest.mark.timeout(400)
def test_train_through_the_example_agent(tiny, tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "headrace.cli", "train", "examples/gateway_reasoning.yaml", "--json",
         "--set", f"run.dir={run_dir}", "--set", f"model.init_from=hf:{tiny}",
         "--set", "run.max_steps=2", "--set", "run.max_wall_s=0",
         "--set", "actor.envs_per_actor=8", "--set", "actor.max_batch=8",
         "--set", "actor.group_size=4", "--set", "learner.groups_per_batch=1",
         "--set", "sampling.max_new_tokens=8", "--set", "env.kwargs.tasks.kwargs.eval_size=8",
         "--set", "staleness.max_policy_lag=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=380)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["steps"] == 2 and summary["errors"] == [], summary
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last["gateway/requests"] >= 8 and last["gateway/sessions"] >= 8, last
    assert last.get("gateway/agent_errors", 0) == 0
    trained = [r for r in records if "is/ratio_mean" in r]
    assert trained and all(abs(r["is/ratio_mean"] - 1) < 1e-2 for r in trained)  # lag 0, fp32
    assert all(r.get("staleness/lag_max", 0) == 0 for r in trained)
