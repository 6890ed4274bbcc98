"""Learner crash safety at thread level: checkpoints, acknowledgement after them, resume, ledger.

A crash is simulated by making the learner fail at a chosen point (a train step, an ack) and then
`MemoryBuffer.restart_consumer()`, which hands every unacknowledged entry out again, as a restarted
learner would see them; a new `Learner` on the same checkpoint folder and ledger then resumes.
"""

from __future__ import annotations

import json
import threading
import time

import jax
import numpy as np
import pytest

from headrace.buffer.memory import MemoryBuffer
from headrace.config import load
from headrace.learner.book import Book, Position
from headrace.learner.checkpoint import Checkpointer
from headrace.learner.loop import Learner
from headrace.metrics.core import Metrics
from headrace.rundir import RunDir
from headrace.runtime import build, resume
from headrace.types import Group, Trajectory, Turn
from headrace.weights.memory import MemoryWeightStore

GROUPS_PER_BATCH = 2
OLD = 10_000.0  # seconds: older than max_age_s, so the gate drops the group ("age")


def make_config(**run):
    overrides = [f"run.{k}={v}" for k, v in run.items()] + [
        f"learner.groups_per_batch={GROUPS_PER_BATCH}", "learner.minibatches=1",
        "buffer.max_pending=64", "staleness.max_age_s=1000", "staleness.max_policy_lag=1000"]
    return load("examples/guess_number.yaml", overrides)


def actions(model) -> np.ndarray:
    task = model[0]
    return np.flatnonzero(task.sampler_settings.allowed_mask(task.dims.vocab_size))


@pytest.fixture(scope="module")
def model():
    config = make_config()
    task = build.build_task(config)
    graphdef, params = build.init_params(config, task)
    return task, graphdef, params


def make_group(index: int, allowed: np.ndarray, *, stale: bool = False) -> Group:
    """A valid group; its tokens are actions the constrained sampler could have chosen."""
    rng = np.random.default_rng(index)
    group_id = f"g{index:03d}"
    started = time.time() - (OLD if stale else 0.0)
    trajectories = []
    for j in range(2):
        n = 6
        trajectories.append(Trajectory(
            trajectory_id=f"{group_id}.{j}", group_id=group_id, task_id=f"t{index}",
            env="guess_number", actor_id="a0",
            tokens=rng.choice(allowed, n).astype(np.int32),
            loss_mask=np.arange(n) % 2 == 1,
            behaviour_logprobs=np.where(np.arange(n) % 2 == 1, -1.5, 0.0).astype(np.float32),
            policy_version=np.where(np.arange(n) % 2 == 1, 0, -1).astype(np.int32),
            turns=[Turn(0, 3, "user"), Turn(3, n, "assistant", float(j))],
            reward=float(j), timings={"started": started}))
    return Group(group_id, f"t{index}", trajectories, put_version=0)


class Crash(RuntimeError):
    """The injected failure."""


def run_learner(learner: Learner, timeout_s: float = 60.0) -> BaseException | None:
    """Runs `learner.run()` on a thread; returns its exception (None when it ended cleanly)."""
    errors: list[BaseException] = []

    def target():
        try:
            learner.run()
        except BaseException as error:  # handed to the test
            errors.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "the learner did not finish in time"
    return errors[0] if errors else None


def new_learner(config, model, buffer, weights, run_dir):
    task, graphdef, params = model
    checkpointer = Checkpointer(run_dir / RunDir.CHECKPOINTS, keep=resume.CHECKPOINTS_KEPT)
    ledger = resume.Ledger(run_dir / RunDir.LEDGER)
    learner = build.make_learner(config, task, graphdef, params, buffer, weights, Metrics(),
                                 threading.Event(), checkpointer=checkpointer, ledger=ledger)
    learner.publish_start()
    return learner, checkpointer, ledger


def fail_on_call(learner: Learner, n: int) -> None:
    """Makes the learner's n-th train step from now raise `Crash`."""
    inner, calls = learner._train_step, [0]

    def step(state, batch):
        calls[0] += 1
        if calls[0] == n:
            raise Crash(f"injected crash in train step {n}")
        return inner(state, batch)

    learner._train_step = step


def drain(buffer: MemoryBuffer) -> set[str]:
    """Group ids of every entry still in the buffer (undelivered or pending)."""
    buffer.restart_consumer()
    return {e.group.group_id for e in buffer.get(10_000, timeout_s=0.1)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("write", ["blocking", "background"])
def test_crash_after_a_checkpoint_loses_nothing_and_trains_nothing_twice(tmp_path, model, write):
    vocab = actions(model)
    buffer, weights = MemoryBuffer(capacity=1000, max_pending=64), MemoryWeightStore(8)
    written = {make_group(i, vocab, stale=i % 5 == 4).group_id for i in range(30)}
    buffer.put([make_group(i, vocab, stale=i % 5 == 4) for i in range(30)], timeout_s=1)

    config = make_config(checkpoint_every=2, max_steps=100, checkpoint_write=write)
    first, checkpointer, ledger = new_learner(config, model, buffer, weights, tmp_path)
    assert first.restored_from is None and weights.latest_version() == 0
    fail_on_call(first, 6)  # steps 1-5 train (checkpoints at 2 and 4), step 6 crashes
    assert isinstance(run_learner(first), Crash)
    checkpointer.close()
    ledger.close()
    assert first.step == 5 and checkpointer.all_steps() == [2, 4]
    counters_at_4 = checkpointer.read_metadata(4)["counters"]

    buffer.restart_consumer()  # the learner process died: its pending entries come back
    config = make_config(checkpoint_every=2, max_steps=9, checkpoint_write=write)
    second, checkpointer, ledger = new_learner(config, model, buffer, weights, tmp_path)
    assert second.restored_from == 4 and second.step == 4
    assert second.version == weights.latest_version() == 6  # after the store's 5, not the 4
    assert second.metrics.counters["learner/groups"] == counters_at_4["learner/groups"] == 8
    assert run_learner(second) is None
    checkpointer.close()
    ledger.close()
    assert second.step == 9 and checkpointer.latest_step() == 9
    assert second.metrics.counters["learner/groups"] == 9 * GROUPS_PER_BATCH

    replay = resume.history(tmp_path, latest=9)
    assert replay.starts == 2
    trained = [g for r in replay.effective if r["kind"] == "trained" for g in r["groups"]]
    dropped = {g for r in replay.effective if r["kind"] == "dropped" for g in r["groups"]}
    assert len(trained) == len(set(trained)) == 9 * GROUPS_PER_BATCH  # nothing trained twice
    assert all(int(g[1:]) % 5 == 4 for g in dropped) and dropped  # the stale ones, by age
    assert not set(trained) & dropped
    remaining = drain(buffer)
    assert set(trained) | dropped | remaining == written  # nothing lost
    assert not (set(trained) | dropped) & remaining
    # Step 5 was trained after checkpoint 4 and lost with the crash: redelivered, trained again.
    retrained = {g for r in replay.void if r["kind"] == "trained" for g in r["groups"]}
    assert len(retrained) == GROUPS_PER_BATCH and retrained <= set(trained)
    again = {g for r in replay.effective for g, d in zip(r["groups"], r["deliveries"],
                                                         strict=True) if d > 1}
    assert retrained <= again
    metadata = Checkpointer(tmp_path / RunDir.CHECKPOINTS).read_metadata()
    assert metadata["counters"]["staleness/dropped_age"] == len(
        [r for r in replay.effective if r["kind"] == "dropped"])


@pytest.mark.timeout(120)
def test_entries_a_checkpoint_covers_are_skipped_when_redelivered(tmp_path, model):
    vocab = actions(model)
    buffer, weights = MemoryBuffer(capacity=1000, max_pending=64), MemoryWeightStore(8)
    buffer.put([make_group(i, vocab) for i in range(12)], timeout_s=1)
    config = make_config(checkpoint_every=2, max_steps=100)
    first, checkpointer, ledger = new_learner(config, model, buffer, weights, tmp_path)
    ack = buffer.ack

    def crash_on_ack(ids):  # the save is complete; the process dies before acknowledging
        raise Crash("injected crash between checkpoint save and ack")

    buffer.ack = crash_on_ack
    assert isinstance(run_learner(first), Crash)
    checkpointer.close()
    ledger.close()
    buffer.ack = ack
    covered = set(checkpointer.read_metadata(2)["unacked"])
    assert len(covered) == 2 * GROUPS_PER_BATCH and buffer.pending() > 0

    buffer.restart_consumer()
    second, checkpointer, ledger = new_learner(make_config(checkpoint_every=2, max_steps=4),
                                               model, buffer, weights, tmp_path)
    assert second.restored_from == 2
    assert run_learner(second) is None
    checkpointer.close()
    ledger.close()
    assert second.metrics.counters["buffer/redelivered_skipped"] == len(covered)
    replay = resume.history(tmp_path, latest=4)
    skipped = [i for r in replay.effective if r["kind"] == "skipped" for i in r["ids"]]
    trained = [i for r in replay.effective if r["kind"] == "trained" for i in r["ids"]]
    assert set(skipped) == covered and len(trained) == len(set(trained)) == 8
    assert not replay.void  # the crash came after the save: nothing was lost
    left = drain(buffer)
    assert len(left) == 12 - 8  # the skipped ones were acknowledged, not left pending


class HeldWrite:
    """A real `Checkpointer` whose background writes count as unfinished until `done` is set."""

    def __init__(self, inner: Checkpointer):
        self.inner, self.done = inner, threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def saving(self) -> bool:
        return not self.done.is_set() or self.inner.saving()

    def wait(self) -> None:
        assert self.done.wait(30), "the held write was never released"
        self.inner.wait()


@pytest.mark.timeout(120)
def test_a_background_checkpoint_acknowledges_what_it_covers_once_complete(tmp_path, model):
    vocab = actions(model)
    _, _, params = model
    buffer = MemoryBuffer(capacity=100, max_pending=64)
    buffer.put([make_group(i, vocab) for i in range(6)], timeout_s=1)
    entries = buffer.get(6, timeout_s=1)
    checkpointer = HeldWrite(Checkpointer(tmp_path / "checkpoints"))
    config = make_config(checkpoint_every=2, checkpoint_write="background")
    book = Book(config, buffer, Metrics(), checkpointer)
    assert book.background
    assert not Book(make_config(checkpoint_every=2), buffer, Metrics(), checkpointer).background \
        or jax.default_backend() != "cpu"  # "auto": blocking on a CPU
    book.hold(entries)
    book.trained(entries[:2], 1)
    book.trained(entries[2:4], 2)
    book.checkpoint(params, Position(2, 2, 0), wait=False)  # what the loop does when due
    book.settle()  # the files are still being written: nothing acknowledged
    assert buffer.pending() == 6 and len(book.unacked) == 4
    book.trained(entries[4:], 3)
    checkpointer.done.set()
    checkpointer.inner.wait()  # the files are complete
    book.settle()  # as after every step: not blocking
    assert buffer.pending() == 2 and [e.id for e in entries[4:]] == book.unacked
    assert set(checkpointer.read_metadata(2)["unacked"]) == {e.id for e in entries[:4]}
    # The next checkpoint lists only what came after the first one's.
    checkpointer.done.clear()
    book.checkpoint(params, Position(3, 3, 0), wait=False)
    book.trained([], 4)
    assert buffer.pending() == 2
    checkpointer.done.set()
    book.checkpoint(params, Position(4, 4, 0))  # the final one waits for it: all acknowledged
    assert buffer.pending() == 0 and not book.unacked
    assert set(checkpointer.read_metadata(3)["unacked"]) == {e.id for e in entries[4:]}
    checkpointer.close()


@pytest.mark.timeout(120)
def test_drops_filling_max_pending_force_an_early_checkpoint(tmp_path, model):
    vocab = actions(model)
    buffer, weights = MemoryBuffer(capacity=1000, max_pending=4), MemoryWeightStore(8)
    buffer.put([make_group(i, vocab, stale=i < 6) for i in range(8)], timeout_s=1)
    config = load("examples/guess_number.yaml", [
        "run.checkpoint_every=100", "run.max_steps=1", "buffer.max_pending=4",
        f"learner.groups_per_batch={GROUPS_PER_BATCH}", "learner.minibatches=1",
        "staleness.max_age_s=1000", "staleness.max_policy_lag=1000"])
    learner, checkpointer, ledger = new_learner(config, model, buffer, weights, tmp_path)
    assert run_learner(learner, timeout_s=60) is None  # no deadlock on a full pending list
    steps = checkpointer.all_steps()
    checkpointer.close()
    ledger.close()
    assert learner.step == 1 and steps[0] == 0 and steps[-1] == 1  # early (key 0), then final
    assert learner.metrics.counters["staleness/dropped_age"] == 6
    assert buffer.pending() == 0 and buffer.depth() == 0


def write_ledger(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def trained(step, *groups):
    return {"kind": "trained", "step": step, "ids": list(groups), "groups": list(groups),
            "deliveries": [1] * len(groups)}


def test_history_replays_starts_and_cuts_at_the_restored_checkpoint(tmp_path):
    ledger = tmp_path / RunDir.LEDGER
    write_ledger(ledger / "learner-0000.jsonl", [
        {"kind": "start", "restored": None}, trained(1, "a"), {"kind": "checkpoint", "key": 1},
        trained(2, "b"), {"kind": "checkpoint", "key": 2}, trained(3, "c")])
    write_ledger(ledger / "learner-0001.jsonl", [
        {"kind": "start", "restored": 2}, trained(3, "c"), trained(4, "d")])
    (ledger / "learner-0001.jsonl").write_text(
        (ledger / "learner-0001.jsonl").read_text() + '{"kind": "trai')  # cut short by a crash
    replay = resume.history(tmp_path, latest=2)  # the second start saved nothing
    assert [g for r in replay.effective for g in r["groups"]] == ["a", "b"]
    assert sorted(g for r in replay.void for g in r["groups"]) == ["c", "c", "d"]
    assert replay.starts == 2
    with pytest.raises(resume.LedgerError, match="checkpoint 7"):
        resume.history(tmp_path, latest=7)
    write_ledger(ledger / "learner-0002.jsonl", [{"kind": "start", "restored": 5}])
    with pytest.raises(resume.LedgerError, match="restored checkpoint 5"):
        resume.history(tmp_path, latest=2)


def test_ledger_marks_are_durable_lines(tmp_path):
    ledger = resume.Ledger(tmp_path / "ledger")
    with pytest.raises(resume.LedgerError, match="begin"):
        ledger.mark(1, 1)
    ledger.begin(None)
    ledger.mark(0, 0)
    lines = [json.loads(line) for line in ledger.path.read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["start", "checkpoint"]
    ledger.close()
    second = resume.Ledger(tmp_path / "ledger")
    second.begin(0)
    assert second.path.name == "learner-0001.jsonl"
    second.close()
