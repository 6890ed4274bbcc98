"""A whole run through the real command line with `actor.engine: vllm` (skipped without
.venv-vllm): the actor starts its vLLM server, the learner trains on the server's tokens, and
the versions it publishes flow into the running server (the actor's tokens carry them); with
`model.lora` the versions are adapters, registered with a server serving the run's base."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(1500)

RUN = [
    "--set", "run.launcher=threads", "--set", "weights.backend=dir",
    "--set", "actor.engine=vllm", "--set", "actor.vllm.start_timeout_s=900",
    "--set", "sampling.constrain_to_actions=false",
    # head size 64: vLLM's CPU attention has kernels for 32, 64, 80, 96, 112, 128, 256 only
    "--set", "model.preset=custom", "--set", "model.d_model=128", "--set", "model.n_layers=2",
    "--set", "model.n_heads=2", "--set", "model.n_kv_heads=1", "--set", "model.d_ff=256",
    "--set", "env.kwargs.n=8", "--set", "env.kwargs.max_turns=3",
    "--set", "run.max_steps=8", "--set", "run.max_wall_s=0", "--set", "run.stop_at_target=false",
    "--set", "run.eval_every=1000", "--set", "learner.groups_per_batch=4",
    "--set", "learner.minibatches=1", "--set", "actor.envs_per_actor=32",
    "--set", "actor.max_batch=32", "--set", "buffer.capacity=8", "--set", "buffer.max_pending=64",
]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_run_with_the_vllm_engine_trains_and_its_server_picks_up_versions(vllm_python,
                                                                           tmp_path, lora):
    run_dir = tmp_path / "run"
    extra = ["--set", "model.lora.rank=8"] if lora else []
    result = subprocess.run(
        [sys.executable, "-m", "headrace.cli", "train", "examples/guess_number.yaml", "--json",
         "--set", f"run.dir={run_dir}", *RUN, *extra], capture_output=True, text=True,
        timeout=1450)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout)
    assert summary["steps"] == 8
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seen = max(r.get("actor/weights_version", -1) for r in records)
    print(f"engine versions seen up to {seen}; last record: "
          f"{ {k: v for k, v in records[-1].items() if 'weights' in k or 'is/' in k} }")
    assert seen >= 2, "the server never generated with a version the learner published"
    assert any("weights/pickup_s_p50" in r or "weights/pickup_s" in r for r in records)
    workdir = run_dir / "vllm" / "actor-0"
    assert (workdir / "vllm.log").is_file()
    if lora:  # the server ran the base; the versions were adapter folders (their removal once
        # unused is checked in test_vllm_lora)
        assert (workdir / "base" / "config.json").is_file()
        adapters = sorted(workdir.glob("adapter-v*"))
        assert adapters and all((a / "adapter_config.json").is_file() for a in adapters)
    # the server stopped with the run: no process serves the run's folder any more
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(run_dir / "vllm") not in ps
