"""Bad data never kills or poisons the learner, and redelivery never trains a group twice.

Token ids past the model's vocabulary pass the buffer (it does not know the model) and would turn
every weight into NaN through the embedding lookup: the learner quarantines such a group through
the buffer and trains on. An entry the buffer hands out again while the learner still holds it
(the memory buffer claims idle pending entries back after `buffer.claim_idle_s`) is discarded on
arrival: with acknowledgement right after each step, nothing else would stop it being trained a
second time. Both run the real learner loop on the in-memory buffer, with the real ledger.
"""

from __future__ import annotations

import json
import threading

import jax
import msgpack
import numpy as np
import pytest

from headrace.buffer.memory import MemoryBuffer
from headrace.buffer.serialize import encode
from headrace.config import load
from headrace.metrics.core import Metrics
from headrace.runtime import build, resume
from headrace.weights.memory import MemoryWeightStore
from tests.learner.test_checkpointing import actions, make_group, model  # noqa: F401 (fixture)


def _learner(model, buffer, max_steps: int, ledger=None):  # noqa: F811
    task, graphdef, params = model
    config = load("examples/guess_number.yaml", [
        "learner.groups_per_batch=2", "learner.minibatches=1", "buffer.max_pending=64",
        "staleness.max_policy_lag=1000", f"run.max_steps={max_steps}"])
    learner = build.make_learner(config, task, graphdef, params, buffer, MemoryWeightStore(4),
                                 Metrics(), threading.Event(), ledger=ledger)
    learner.publish_start()
    return learner


def _finite(learner) -> bool:
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(
        jax.device_get(learner.state.params)))


@pytest.mark.timeout(120)
def test_a_token_id_past_the_vocabulary_is_quarantined_and_training_goes_on(model):  # noqa: F811
    task = model[0]
    vocab = task.dims.vocab_size
    buffer = MemoryBuffer(capacity=100, max_pending=64)
    bad = make_group(1, actions(model))
    bad.trajectories[0].tokens[2] = vocab  # one id, one past the end of the embedding table
    ids = buffer.put([make_group(0, actions(model)), bad]
                     + [make_group(i, actions(model)) for i in range(2, 6)], timeout_s=1)
    learner = _learner(model, buffer, max_steps=2)
    learner.run()
    assert learner.step == 2 and _finite(learner)
    stats = buffer.stats()
    assert stats["buffer/quarantined"] == 1 and stats["buffer/quarantined_token_id"] == 1
    data, reason, message = buffer.quarantined[ids[1]]  # kept, with why
    assert reason == "token_id" and f">= the model's vocabulary {vocab}" in message
    assert buffer.pending() + buffer.depth() == 1  # four trained, one quarantined, one left
    buffer.restart_consumer()
    assert [e.id for e in buffer.get(10, timeout_s=0.1)] == ids[-1:]  # never delivered again


def _trained_ids(ledger_dir) -> list[str]:
    return [i for path in sorted(ledger_dir.glob("*.jsonl"))
            for line in path.read_text().splitlines()
            if (record := json.loads(line))["kind"] == "trained" for i in record["ids"]]


@pytest.mark.timeout(120)
def test_entries_claimed_back_while_held_are_never_trained_twice(tmp_path, model):  # noqa: F811
    """claim_idle_s 0.05 s: while the first step compiles (seconds), every entry the learner
    has read is claimed back and handed out again; each is trained exactly once all the same."""
    buffer = MemoryBuffer(capacity=100, max_pending=64, claim_idle_s=0.05)
    ids = buffer.put([make_group(i, actions(model)) for i in range(12)], timeout_s=1)
    ledger = resume.Ledger(tmp_path / "ledger")
    learner = _learner(model, buffer, max_steps=6, ledger=ledger)
    learner.run()
    ledger.close()
    trained = _trained_ids(tmp_path / "ledger")
    assert sorted(trained) == sorted(ids)  # each once: twelve entries, six steps of two
    assert learner.metrics.counters["buffer/redelivered_held"] > 0  # copies came, and went
    assert buffer.stats()["buffer/redelivered"] > 0
    assert buffer.pending() == 0 and buffer.depth() == 0  # acknowledged copies are gone too


def _with(group, path: tuple, value) -> bytes:
    record = msgpack.unpackb(encode(group), raw=False)
    node = record
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return msgpack.packb(record, use_bin_type=True)


@pytest.mark.timeout(120)
def test_bad_values_neither_kill_the_reader_nor_crash_the_batcher(model):  # noqa: F811
    """`put_version: inf` killed the reader thread (and the memory buffer lost the entry);
    `reward: "abc"` crashed the batcher. Both are quarantined now, and the run trains on."""
    buffer = MemoryBuffer(capacity=100, max_pending=64)
    good = [make_group(i, actions(model)) for i in range(6)]
    buffer.put(good[:2], timeout_s=1)
    bad = [buffer.put_raw(_with(good[0], ("group", "put_version"), float("inf"))),
           buffer.put_raw(_with(good[1], ("trajectories", 1, "reward"), "abc"))]
    buffer.put(good[2:], timeout_s=1)
    learner = _learner(model, buffer, max_steps=3)
    learner.run()
    assert learner.step == 3 and _finite(learner)
    assert set(buffer.quarantined) == set(bad)
    stats = buffer.stats()
    assert stats["buffer/quarantined_non_finite"] == 1 and stats["buffer/quarantined_type"] == 1
    assert learner.metrics.counters["learner/groups"] == 6
