"""A malformed entry is quarantined and counted while training continues (a real run).

The processes launcher (supervisor, learner process, actor process) over a real redis-server, with
the run's ledger on. Once the learner has trained its first step, the test plants three bad entries
in the run's stream, the way a broken or foreign writer would: garbage bytes, a group of another
schema version, and a msgpack payload cut in half. The run must still reach `run.max_steps`,
train entries written after the bad ones, move exactly those three to the quarantine stream (with
their ids, bytes and reasons), count them in `buffer/quarantined`, and keep the accounting identity
(docs/design.md) exactly: written = trained ∪ dropped ∪ quarantined ∪ still in the buffer.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import threading
import time

import msgpack
import pytest

from headrace.buffer.redis_stream import RedisBuffer
from headrace.buffer.serialize import encode
from headrace.config import load
from headrace.metrics.remote import metrics_key
from headrace.rundir import RunDir
from headrace.runtime import processes
from headrace.runtime.accounting import accounting
from headrace.types import SCHEMA_VERSION, Group
from headrace.weights.directory import DirWeightStore

MAX_STEPS = 12
GROUPS_PER_BATCH = 4
INJECT_AT_VERSION = 1  # the learner has trained (and published) its first step


def bad_payloads(good: Group) -> dict[str, tuple[bytes, str]]:
    """Three malformed entries: name -> (bytes, how the quarantine reason starts)."""
    good = encode(good)
    record = msgpack.unpackb(good, raw=False)
    record["v"] = SCHEMA_VERSION + 1
    return {
        "garbage": (b"\xc1 garbage, not msgpack \x00\xff", "not a msgpack record"),  # 0xc1: never
        "schema": (msgpack.packb(record, use_bin_type=True),
                   f"schema version {SCHEMA_VERSION + 1}, expected {SCHEMA_VERSION}"),
        "truncated": (good[:len(good) // 2], "not a msgpack record"),
    }


class Injector(threading.Thread):
    """Waits until the run has trained a step, then plants the bad entries in its stream."""

    def __init__(self, run_dir: pathlib.Path, url: str, payloads: dict[str, tuple[bytes, str]],
                 deadline_s: float = 90.0):
        super().__init__(name="injector", daemon=True)
        self.run_dir, self.url, self.payloads = run_dir, url, payloads
        self.deadline = time.monotonic() + deadline_s
        self.stop = threading.Event()
        self.ids: dict[str, str] = {}  # name -> entry id
        self.version_at_injection: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            run_file = self.run_dir / RunDir.RUN
            weights = DirWeightStore(self.run_dir / RunDir.WEIGHTS)
            while not (run_file.exists() and weights.latest_version() >= INJECT_AT_VERSION):
                if self.stop.wait(0.01):
                    return
                if time.monotonic() > self.deadline:
                    raise TimeoutError("the run trained no step in time")
            self.version_at_injection = weights.latest_version()
            run_id = json.loads(run_file.read_text())["run_id"]
            buffer = RedisBuffer(self.url, run_id=run_id, consumer="injector", ledger=False)
            try:
                for name, (data, _) in self.payloads.items():
                    self.ids[name] = buffer.put_raw(data)
            finally:
                buffer.close()
        except BaseException as error:  # reported by the test
            self.error = error


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def _children() -> dict[int, str]:
    """Live child processes of this process: pid -> command line."""
    me, found = os.getpid(), {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            found[int(entry.name)] = cmdline
    return found


@pytest.mark.timeout(420)
def test_malformed_entries_are_quarantined_and_counted_while_training_continues(
        tmp_path, redis_server_factory, group_factory):
    server = redis_server_factory().start()
    run_dir = tmp_path / "run"
    config = load("examples/guess_number.yaml", [
        "run.launcher=processes", f"run.dir={run_dir}", "run.ledger=true",
        f"run.max_steps={MAX_STEPS}", "run.max_wall_s=0", "run.eval_every=0",
        "run.stop_at_target=false", "env.kwargs.n=8", "env.kwargs.max_turns=3",
        f"learner.groups_per_batch={GROUPS_PER_BATCH}", "learner.minibatches=1",
        "actor.group_size=4", "actor.envs_per_actor=16", "actor.max_batch=16",
        "buffer.backend=redis", f"buffer.url={server.url}", "buffer.capacity=8",
        "weights.backend=dir",
    ])
    payloads = bad_payloads(group_factory(7))
    before = set(_children())
    injector = Injector(run_dir, server.url, payloads, deadline_s=300)  # a loaded machine
    injector.start()
    try:
        summary = processes.train(config, live=False)
    finally:
        injector.stop.set()
        injector.join(timeout=10)
    assert injector.error is None, repr(injector.error)
    assert len(injector.ids) == 3, injector.ids
    # Nothing of the run is left behind (the redis-server is the fixture's).
    assert not multiprocessing.active_children()
    left = {pid: cmd for pid, cmd in _children().items()
            if pid not in before and pid != server.pid and "resource_tracker" not in cmd}
    assert not left, left

    # The run went on to its end, past the bad entries.
    assert summary["errors"] == [] and summary["stopped_by"] == "max_steps", summary
    assert summary["steps"] == MAX_STEPS
    assert injector.version_at_injection < MAX_STEPS
    newest_bad = max(_stream_id(i) for i in injector.ids.values())
    trained_ids = [i for path in sorted((run_dir / RunDir.LEDGER).glob("learner-*.jsonl"))
                   for line in path.read_text().splitlines()
                   if (record := json.loads(line))["kind"] == "trained" for i in record["ids"]]
    assert len(trained_ids) == MAX_STEPS * GROUPS_PER_BATCH
    assert any(_stream_id(i) > newest_bad for i in trained_ids), "nothing trained after them"

    # Quarantined: exactly the bad entries, with their bytes and reasons; counted.
    run_id = json.loads((run_dir / RunDir.RUN).read_text())["run_id"]
    client = server.client()
    buffer = RedisBuffer(client, run_id=run_id, consumer="check", ledger=False)
    try:
        moved = {f[b"id"].decode(): f for _, f in client.xrange(buffer.quarantine_key)}
        assert set(moved) == set(injector.ids.values())
        for name, entry_id in injector.ids.items():
            data, reason = payloads[name]
            assert moved[entry_id][b"group"] == data, name
            assert moved[entry_id][b"reason"].decode().startswith(reason), moved[entry_id]
            assert moved[entry_id][b"consumer"] == b"learner-0"
        assert buffer.stats()["buffer/quarantined"] == 3
        learner = json.loads(client.hget(metrics_key(run_id), "learner"))
        assert learner["values"]["buffer/quarantined"] == 3  # the learner's own report
        last = json.loads((run_dir / RunDir.METRICS).read_text().splitlines()[-1])
        assert last["buffer/quarantined"] == 3 and last["step"] == MAX_STEPS

        # The accounting identity, exactly, by group id (bad entries count as `entry:<id>`).
        result = accounting(run_dir, client)
    finally:
        client.close()
    bad = {f"entry:{i}" for i in injector.ids.values()}
    assert result["quarantined"] == bad
    assert result["added"] == len(result["written"]) + len(bad)  # every good put recorded
    assert not result["missing"], sorted(result["missing"])[:10]
    assert not result["trained_twice"], sorted(result["trained_twice"])[:10]
    assert not result["unrecorded"], sorted(result["unrecorded"])[:10]
    handled = result["trained"].union(*result["dropped_by_reason"].values())
    assert handled | result["quarantined"] | result["in_buffer"] == result["written"] | bad
    assert len(result["trained"]) == MAX_STEPS * GROUPS_PER_BATCH
    assert not result["counter_mismatches"], result["counter_mismatches"]
    assert result["checkpoint"]["learner_step"] == MAX_STEPS
