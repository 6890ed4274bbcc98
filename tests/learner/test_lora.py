"""LoRA in the learner: the train step differentiates and updates the adapters alone (the base is
bit-identical after training, the optimizer state is the adapters' size), the loss goes down, the
KL reference and the decoupled proximal policy are the base plus adapters; and a whole run
(processes launcher, through the command line) publishes adapters only, checkpoints them, and
exports a PEFT adapter that peft loads with headrace's logits and merged weights transformers
loads alone."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax
import jax.extend
import numpy as np
import pytest

from headrace.learner.train_step import init_state, make_optimizer, make_train_step
from headrace.model import lora
from headrace.model import params as params_lib
from tests.parallel.helpers import DIMS, learner_config, make_batch

ROOT = pathlib.Path(__file__).resolve().parents[2]

SPEC = lora.LoraSpec(4, 8.0, tuple(lora.TARGETS))


def _sizes(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,kl", [("ppo_clip", 0.0), ("decoupled", 0.1)])
def test_a_lora_step_trains_the_adapters_only_and_the_loss_goes_down(kind, kl):
    graphdef, base = params_lib.init(DIMS, 0)
    base_before = jax.device_get(base)
    config = learner_config(kind, kl_coef=kl, lr=3e-3)
    optimizer = make_optimizer(config.optimizer)
    step = make_train_step(graphdef, config, 1.0, optimizer, lora=SPEC)
    step.freeze(base)
    adapters = lora.init(base, SPEC, 1)
    state = init_state(adapters, optimizer, kl)
    n_adapters = _sizes(state.params)
    expected = sum(int(np.prod(s)) for s in lora.shapes(base, SPEC).values())
    assert n_adapters == expected < params_lib.count(base) // 4
    # AdamW: a first and a second moment per adapter entry, plus scalar counts; nothing for
    # the base's 70k parameters.
    opt_leaves = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x)]
    assert _sizes(opt_leaves) == 2 * n_adapters
    assert state.ref_params is None or _sizes(state.ref_params) == n_adapters
    batch = make_batch()
    losses = []
    for _ in range(6):  # the same batch, six steps: its loss goes down
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss/total"]))
    assert losses[-1] < losses[0] - 1e-3, losses
    assert np.isfinite(losses).all()
    for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(step.frozen), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the base: bit for bit
    moved = params_lib.flatten(jax.device_get(state.params))
    assert all(np.abs(v).max() > 0 for k, v in moved.items() if k.endswith(lora.B))


@pytest.mark.timeout(120)
def test_a_lora_step_without_its_base_says_so():
    graphdef, base = params_lib.init(DIMS, 0)
    config = learner_config()
    step = make_train_step(graphdef, config, 1.0, make_optimizer(config.optimizer), lora=SPEC)
    state = init_state(lora.init(base, SPEC, 1), step.optimizer, 0.0)
    with pytest.raises(RuntimeError, match="freeze"):
        step(state, make_batch())


RUN = {
    "run": {"seed": 0, "launcher": "processes", "max_steps": 4, "eval_every": 0,
            "checkpoint_every": 2, "log_every": 1, "max_wall_s": 240},
    "env": {"name": "guess_number", "kwargs": {"n": 8, "max_turns": 3}},
    "model": {"preset": "tiny", "max_len": 64,
              "lora": {"rank": 2, "alpha": 4.0, "targets": ["q", "v", "up"]}},
    "sampling": {"max_new_tokens": 1, "constrain_to_actions": True},
    "actor": {"envs_per_actor": 16, "group_size": 4, "max_batch": 16},
    "buffer": {"capacity": 8},
    "weights": {"backend": "dir"},
    "learner": {"groups_per_batch": 2, "minibatches": 1, "publish_every": 1,
                "optimizer": {"lr": 1.0e-2}},
    "shapes": {"buckets": [8, 12]},
}


@pytest.mark.timeout(600)
def test_a_lora_run_publishes_adapters_only_and_exports_a_peft_adapter(tmp_path, capsys):
    pytest.importorskip("peft")
    import yaml

    from headrace.cli import main
    from headrace.config import load
    from headrace.runtime import build
    from headrace.weights.directory import DirWeightStore

    run_dir = tmp_path / "run"
    config_path = tmp_path / "lora.yaml"
    config_path.write_text(yaml.safe_dump({**RUN, "run": {**RUN["run"], "dir": str(run_dir)}}))
    # Through the command line in a process of its own, as a user runs it (not in this process,
    # whose state the tests before it shaped).
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "train", str(config_path),
                             "--json", "--no-live"], capture_output=True, text=True,
                            timeout=480, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["stopped_by"] == "max_steps", (summary, result.stderr[-3000:])
    config = load(run_dir / "config.yaml")
    task = build.build_task(config)
    _, base = params_lib.init(task.dims, config.run.seed)  # the run's frozen base
    spec = lora.LoraSpec.of(config.model.lora)
    expected = lora.shapes(base, spec)

    store = DirWeightStore(run_dir / "weights", keep=1)
    latest = store.latest_version()
    assert latest == RUN["run"]["max_steps"], summary  # every step published
    first, last = store.load(0), store.load(latest)
    for flat in (first, last):  # adapters only on the wire: exactly their keys and shapes
        lora.check(flat, expected, "published version")
    assert lora.wire_bytes(last) * 20 < lora.wire_bytes(params_lib.to_host(base))
    assert not any(np.abs(v).max() for k, v in first.items() if k.endswith(lora.B))
    assert any(np.abs(v).max() > 0 for k, v in last.items() if k.endswith(lora.B))

    # Export: a PEFT adapter (the base, fresh weights, exported beside it) and merged weights.
    out = tmp_path / "adapter"
    assert main(["export", str(run_dir), "--hf", str(out), "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["adapter"] and (out / "adapter_model.safetensors").is_file()
    assert main(["export", str(run_dir), "--hf", str(tmp_path / "merged"), "--merge"]) == 0
    capsys.readouterr()

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from headrace.sft.warm_start import restore_params
    from tests.model.test_lora import HF_TOL, _logits

    adapters, _ = restore_params(run_dir / "checkpoints", config, task.dims, adapters_only=True)
    tokens = np.random.default_rng(0).integers(0, task.dims.vocab_size, (2, 10))
    ours = _logits(task.dims, base, tokens, adapters, spec.scale)
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(exported["base"], dtype=torch.float32), out)
    model.eval()
    with torch.no_grad():
        peft_logits = model(torch.as_tensor(tokens)).logits.double().numpy()
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        merged_logits = merged(torch.as_tensor(tokens)).logits.double().numpy()
    assert np.abs(peft_logits - ours).max() <= HF_TOL
    assert np.abs(merged_logits - ours).max() <= HF_TOL
    assert np.abs(ours - _logits(task.dims, base, tokens)).max() > 0  # the adapters moved it


def _weight_sized_products(fn, *args) -> list[tuple[int, ...]]:
    """Shapes of the 2-D dot products in `fn`'s program whose shape is a base kernel's (or the
    embedding table's): a weight gradient (activations here are 3-D and more)."""
    _, base = params_lib.init(DIMS, 0)
    shapes = {tuple(v.shape) for k, v in params_lib.flatten(base).items() if v.ndim == 2}
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                shape = tuple(eqn.outvars[0].aval.shape)
                if shape in shapes:
                    found.append(shape)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.timeout(120)
def test_no_gradient_of_the_base_is_formed():
    graphdef, base = params_lib.init(DIMS, 0)
    config = learner_config()
    mb = {k: v for k, v in make_batch().microbatches[0].arrays.items()}
    full = make_train_step(graphdef, config, 1.0, make_optimizer(config.optimizer))
    full.dims = DIMS
    assert _weight_sized_products(lambda p: full.grads_and_sums(p, mb, None, None), base)
    step = make_train_step(graphdef, config, 1.0, make_optimizer(config.optimizer), lora=SPEC)
    step.dims = DIMS
    adapters = lora.init(base, SPEC, 1)
    assert not _weight_sized_products(
        lambda a, b: step.grads_and_sums(a, mb, None, None, b), adapters, base)


class _Slot:
    """The sampler's weights slot (set_params / version), keeping what was installed."""

    version = -1
    params = None

    def set_params(self, params, version):
        self.params, self.version = params, version


@pytest.mark.timeout(120)
def test_the_actor_merges_each_published_adapter_and_refuses_full_weights():
    from headrace.actor.policy import WeightSync
    from headrace.metrics.core import Metrics
    from headrace.weights.memory import MemoryWeightStore

    _, base = params_lib.init(DIMS, 0)
    trained = jax.tree.map(lambda x: x + 0.1, lora.init(base, SPEC, 1))  # B away from zero
    store, slot, metrics = MemoryWeightStore(4), _Slot(), Metrics()
    sync = WeightSync(store, slot, metrics, poll_s=0.0, loader=lora.Merger(base, SPEC))
    try:
        store.publish(params_lib.to_host(trained), 0)
        assert sync.refresh(force=True).result(timeout=60) and slot.version == 0
        want = lora.merge(base, trained, SPEC)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(slot.params), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        store.publish(params_lib.to_host(base), 1)  # a full-weights version: refused, counted
        assert not sync.refresh(force=True).result(timeout=60) and slot.version == 0
        with pytest.raises(lora.AdapterError, match="full weights"):
            sync.refresh(force=True)
        assert metrics.snapshot()["weights/load_errors"] == 1
    finally:
        sync.close()


@pytest.mark.timeout(180)
def test_a_warm_started_lora_learner_freezes_the_checkpoint_and_publishes_adapters(tmp_path):
    """model.init_from hf:DIR + model.lora: the learner's base is the checkpoint's weights, its
    version 0 is adapters only, and the actors' loader merges it back into that checkpoint."""
    import threading

    from headrace.buffer.memory import MemoryBuffer
    from headrace.metrics.core import Metrics
    from headrace.runtime import build
    from headrace.weights.memory import MemoryWeightStore
    from tests.gateway.helpers import config_for, tiny_checkpoint

    folder = tiny_checkpoint(tmp_path / "ckpt")
    config = config_for(folder, run={"launcher": "threads"},
                        model={"lora": {"rank": 2, "targets": ["q", "down"]}})
    task = build.build_task(config)
    graphdef, params = build.init_params(config, task)
    weights = MemoryWeightStore(4)
    learner = build.make_learner(config, task, graphdef, params, MemoryBuffer(capacity=8),
                                 weights, Metrics(), threading.Event())
    try:
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(learner._train_step.frozen),
                        strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        learner.publish(wait=True)
        flat = weights.load(0)
        spec = lora.LoraSpec.of(config.model.lora)
        lora.check(flat, lora.shapes(params, spec), "version 0")
        assert len(flat) == 2 * 2 * task.dims.n_layers  # q and down, A and B, per layer
        merged = build.weights_loader(config, task)(flat)  # loads the checkpoint itself
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(merged), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # B = 0: the base
    finally:
        learner.publisher.close()
