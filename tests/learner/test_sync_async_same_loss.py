"""With zero staleness, `run.mode: sync` and `async` compute the same loss on the same data.

An invariant of docs/design.md. The two modes share the learner: `Learner` never reads `run.mode`; the
modes differ in admission (`AdmissionLimits.from_config`: sync is lag 0 with a publish after every
step, so actors generate exactly one batch at the learner's version, then wait) and in the config
rule that sync publishes every step. So the test drives both through the threads launcher a
user's run takes (`headrace.runtime.threads.train`), with two seams patched in: the buffer
factory (records every group put, in buffer order; or hands out a pre-filled buffer) and the
learner class (a subclass that records each step's batch and metrics).

1. sync: a real run, actors generating at the learner's current version, `max_steps` steps.
2. async: the same initial params (same seed), fed the groups the sync run trained on, in the
   same order, from a pre-filled buffer (the async way: no waiting on actors). Group k of step s
   was generated at version s - 1 and is trained at version s - 1, so staleness is zero here too;
   `staleness.max_policy_lag: 0` makes the gate drop (and count) anything else.

Then every step's batch, loss parts and norms, and the weights published at every version, are
equal (float32 tolerance).
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np
import pytest

from headrace.buffer.admission import AdmissionLimits
from headrace.buffer.memory import MemoryBuffer
from headrace.buffer.serialize import decode, encode
from headrace.config import load
from headrace.learner.loop import Learner
from headrace.runtime import build, threads

STEPS = 4
GROUPS_PER_BATCH = 4
TOLERANCE = dict(rtol=1e-5, atol=1e-6)  # float32; the two runs execute the same program
STEP_METRICS = ("loss/total", "loss/pg", "loss/entropy", "learner/grad_norm",
                "learner/update_norm", "learner/param_norm", "is/ratio_mean", "is/ess")


def make_config(tmp_path, mode: str):
    return load("examples/guess_number.yaml", [
        f"run.mode={mode}", f"run.dir={tmp_path}/{mode}", "run.launcher=threads",
        f"run.max_steps={STEPS}", "run.max_wall_s=0", "run.eval_every=0",
        "run.stop_at_target=false", "run.seed=3",
        "env.kwargs.n=8", "env.kwargs.max_turns=3",
        f"learner.groups_per_batch={GROUPS_PER_BATCH}", "learner.minibatches=2",
        "learner.publish_every=1", "learner.optimizer.lr=3e-3",
        "actor.group_size=4", "actor.envs_per_actor=16", "actor.max_batch=16",
        f"buffer.capacity={STEPS * GROUPS_PER_BATCH}", "buffer.max_pending=256",
        "staleness.max_policy_lag=0", f"weights.keep={STEPS + 2}",
        "learner.drop_uniform_groups=false",  # every group written is trained, in order
    ])


class RecordingBuffer(MemoryBuffer):
    """A memory buffer that keeps every group put, serialized as stored, by entry id."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.written: dict[int, bytes] = {}

    def put(self, groups, timeout_s):
        ids = super().put(groups, timeout_s)
        for entry_id, group in zip(ids, groups):
            self.written[int(entry_id.split("-")[0])] = encode(group)
        return ids

    def in_order(self) -> list[bytes]:
        return [self.written[k] for k in sorted(self.written)]


def fingerprint(batch) -> str:
    digest = hashlib.sha256()
    for mb in batch.microbatches:
        for name in sorted(mb.arrays):
            digest.update(name.encode())
            digest.update(np.ascontiguousarray(mb.arrays[name]).tobytes())
    return digest.hexdigest()


def run(monkeypatch, config, buffer: MemoryBuffer):
    """`threads.train(config)` over `buffer`; returns (summary, per-step records, weight store)."""
    records: list[dict] = []
    stores = []

    class RecordingLearner(Learner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            inner = self._train_step

            def step(state, batch):
                state, metrics = inner(state, batch)
                record = {k: float(v) for k, v in jax.device_get(metrics).items()}
                snap = self.metrics.snapshot()
                record.update(batch=fingerprint(batch), version=self.version,
                              lag_max=snap["staleness/lag_max"])
                records.append(record)
                return state, metrics

            self._train_step = step

    make_weights = build.make_weights

    def weights_factory(*args, **kwargs):
        stores.append(make_weights(*args, **kwargs))
        return stores[-1]

    with monkeypatch.context() as patch:
        patch.setattr(build, "Learner", RecordingLearner)
        patch.setattr(build, "make_buffer", lambda *args, **kwargs: buffer)
        patch.setattr(build, "make_weights", weights_factory)
        summary = threads.train(config, live=False)
    return summary, records, stores[0]


@pytest.mark.timeout(120)
def test_sync_and_async_compute_the_same_loss_on_the_same_data(tmp_path, monkeypatch):
    sync_config, async_config = make_config(tmp_path, "sync"), make_config(tmp_path, "async")
    # Where the modes differ: admission alone (the learner never reads run.mode).
    assert AdmissionLimits.from_config(sync_config) == AdmissionLimits(GROUPS_PER_BATCH, 1, 0)

    # 1. sync: actors generate each batch at the learner's current version.
    recorder = RecordingBuffer(sync_config.buffer.capacity, sync_config.buffer.max_pending)
    summary, sync_steps, sync_weights = run(monkeypatch, sync_config, recorder)
    assert summary["errors"] == [] and summary["steps"] == STEPS, summary
    assert len(sync_steps) == STEPS
    assert [r["version"] for r in sync_steps] == list(range(STEPS))
    assert all(r["lag_max"] == 0 for r in sync_steps), sync_steps  # zero staleness
    trained = recorder.in_order()[:STEPS * GROUPS_PER_BATCH]
    for s in range(STEPS):  # each batch was generated at the version it was trained at
        for data in trained[s * GROUPS_PER_BATCH:(s + 1) * GROUPS_PER_BATCH]:
            assert decode(data).oldest_version == s

    # 2. async: the same groups, in the same order, from a pre-filled buffer.
    prefilled = MemoryBuffer(async_config.buffer.capacity, async_config.buffer.max_pending)
    prefilled.put([decode(data) for data in trained], timeout_s=1)
    summary, async_steps, async_weights = run(monkeypatch, async_config, prefilled)
    assert summary["errors"] == [] and summary["steps"] == STEPS, summary
    assert [r["version"] for r in async_steps] == list(range(STEPS))
    assert all(r["lag_max"] == 0 for r in async_steps), async_steps

    # Same data, same loss, same metrics, step by step; same weights at every version.
    assert [r["batch"] for r in async_steps] == [r["batch"] for r in sync_steps]
    for s, (a, b) in enumerate(zip(sync_steps, async_steps)):
        for name in STEP_METRICS:
            np.testing.assert_allclose(b[name], a[name], **TOLERANCE,
                                       err_msg=f"step {s + 1}: {name}")
    assert sync_steps[-1]["learner/update_norm"] > 0  # the steps really changed the weights
    assert sync_weights.latest_version() == async_weights.latest_version() == STEPS
    for version in range(STEPS + 1):
        expected, got = sync_weights.load(version), async_weights.load(version)
        assert expected.keys() == got.keys()
        for name in expected:
            np.testing.assert_allclose(got[name], expected[name], **TOLERANCE,
                                       err_msg=f"version {version}: {name}")
    initial, final = sync_weights.load(0), sync_weights.load(STEPS)
    assert any(not np.allclose(initial[k], final[k]) for k in initial)
