"""The learner's acknowledgement book: which entries it holds, handled, trained and has not yet
acknowledged; its checkpoints and its ledger. The only place the learner persists anything.

Acknowledgement (docs/design.md, "Buffer contract"). With a checkpointer and `run.checkpoint_every` > 0
(`periodic`) entries are acknowledged only once a checkpoint that covers them is complete on
disk; otherwise right after their step (a crash then loses them). A periodic checkpoint of one
learner process is written in the background where `run.checkpoint_write` says so ("auto": on an
accelerator): the learner trains on while Orbax writes the files, and `settle` (after every step)
acknowledges what it covers once they are complete; the next checkpoint, an early one and the
final one wait for it first. A checkpoint holds the train
state and metadata: the learner step, the weights version, the steps since the last publish, the
ids handled (trained, dropped, skipped) and not yet acknowledged, and every counter of the
learner's metrics. After a crash the restored ids are skipped if redelivered (never trained
twice); entries trained after the checkpoint were never acknowledged and come back. A ledger, when
given, records every entry handled and is made durable before each save
(`headrace.runtime.resume`). Several learner processes save each checkpoint together; process 0
writes metadata holding every process's entries and counters (`headrace.parallel.multihost`).

Thread safety: `hold` and `release` are called from the reader thread, everything else from the
training thread.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import jax

from headrace.buffer.base import Buffer
from headrace.config import Config
from headrace.metrics.core import Metrics
from headrace.types import Entry

log = logging.getLogger(__name__)


class Position(NamedTuple):
    """Where the learner is: what a checkpoint saves besides the train state."""

    step: int  # learner steps taken
    version: int  # the weights version the next step trains at
    since_publish: int  # steps since that version was published


class Book:
    def __init__(self, config: Config, buffer: Buffer, metrics: Metrics, checkpointer=None,
                 ledger=None, peers=None, report: Callable[[], None] = lambda: None):
        """Args:
          checkpointer: saves and restores checkpoints (`headrace.learner.checkpoint.Checkpointer`
            or the same methods: save, restore, latest_step); None: no checkpoints.
          ledger: records what is done with each entry (`headrace.runtime.resume.Ledger`: begin,
            record, mark); None: no ledger.
          peers: the other learner processes (`multihost.Peers`), or None for one process.
          report: tells admission control the learner's state; called before each acknowledgement
            (admission then counts the acknowledged entries as queued until the ack lands: the
            safe side).
        """
        self.config = config
        self.buffer = buffer
        self.metrics = metrics
        self.checkpointer = checkpointer
        self.ledger = ledger
        self.peers = peers
        self._report = report
        self.step = 0  # the learner step the ledger records handled entries at
        self.unacked: list[str] = []  # handled, not yet acknowledged
        self.trained_ids: set[str] = set()  # trained or covered by the checkpoint, not acked
        self._held: set[str] = set()  # read and not yet acknowledged (or quarantined)
        self._held_lock = threading.Lock()
        self._saving = 0  # how many of `unacked` (the first) the save in flight covers
        write = config.run.checkpoint_write
        self.background = peers is None and (
            write == "background" or (write == "auto" and jax.default_backend() != "cpu"))
        self._key: int | None = None  # the newest checkpoint saved or restored
        self._key_step = 0  # the learner step it holds
        self.restored_from: int | None = None

    # --- what the learner holds -----------------------------------------------------------------

    def hold(self, entries: list[Entry]) -> tuple[list[Entry], int]:
        """The entries not held already (now held), and how many were: a copy the buffer handed
        out again while this learner still holds the entry (read, queued, trained or dropped but
        not yet acknowledged) is never queued twice."""
        with self._held_lock:
            new = [e for e in entries if e.id not in self._held]
            self._held.update(e.id for e in new)
        return new, len(entries) - len(new)

    def release(self, entry_id: str) -> None:
        """Forgets a held entry the buffer took back (quarantined)."""
        with self._held_lock:
            self._held.discard(entry_id)

    def handled(self, kind: str, entries: list[Entry], reason: str | None = None) -> None:
        """Notes entries trained, dropped or skipped: acknowledged after the next checkpoint."""
        self.unacked.extend(e.id for e in entries)
        if self.ledger is not None:
            self.ledger.record(kind, entries, self.step, reason)

    def trained(self, entries: list[Entry], step: int) -> None:
        """Notes the entries learner step `step` trained (skipped if they come again)."""
        self.step = step
        self.trained_ids.update(e.id for e in entries)
        self.handled("trained", entries)

    # --- acknowledgement and checkpoints ------------------------------------------------------

    @property
    def periodic(self) -> bool:
        """Whether entries wait for a periodic checkpoint before they are acknowledged."""
        return self.checkpointer is not None and bool(self.config.run.checkpoint_every)

    def due(self, step: int) -> bool:
        """Whether what step `step` handled is acknowledged now (after a checkpoint if periodic)."""
        return not self.periodic or step % self.config.run.checkpoint_every == 0

    def acknowledge(self, state, at: Position, early: bool = False) -> None:
        """Acknowledges after a checkpoint when checkpoints are periodic (written in the
        background where `background`), else right away. `early`: handled entries fill what the
        buffer may hand out (logged; the checkpoint blocks: the learner cannot go on without the
        acks)."""
        if self.periodic:
            if early:
                log.info("checkpointing early: %d handled entries wait for acknowledgement",
                         len(self.unacked))
            self.checkpoint(state, at, wait=early or not self.background)
        else:
            self.flush()

    def checkpoint(self, state, at: Position, wait: bool = True) -> None:
        """Saves the state and bookkeeping, then acknowledges what it covers: at once (`wait`,
        or several processes), or from `settle` once the files are complete (not `wait`).

        A save in flight is settled first. A no-op when nothing happened since the last
        checkpoint. Without a checkpointer it only acknowledges. The key is the learner step, or
        one past the previous key when no step happened since (a checkpoint that covers only
        dropped or skipped entries). Several processes: every process calls it at the same point
        (it is a collective).
        """
        if self.checkpointer is None:
            self.flush()
            return
        self.settle(wait=True)  # its metadata must not list what an earlier save covers
        if self._key is not None and at.step == self._key_step:
            (handled,) = (bool(self.unacked),) if self.peers is None else \
                self.peers.vote(bool(self.unacked))  # every process saves, or none
            if not handled:
                return
        start = time.perf_counter()
        key = at.step if self._key is None else max(at.step, self._key + 1)
        if self.ledger is not None:
            self.ledger.mark(key, at.step)  # durable before anything it covers is acknowledged
        counters = self.metrics.export()["counters"]
        metadata = {"learner_step": at.step, "weights_version": at.version,
                    "since_publish": at.since_publish, "unacked": list(self.unacked),
                    "counters": counters, "time": time.time()}
        if self.peers is not None:  # process 0 writes the metadata: every process's part in it
            hosts = self.peers.gather_json({"unacked": metadata["unacked"],
                                            "counters": counters})
            metadata["hosts"] = hosts
            metadata["unacked"] = [i for host in hosts for i in host["unacked"]]
            metadata["counters"] = dict(sum((collections.Counter(h["counters"]) for h in hosts),
                                            collections.Counter()))
        # Every process joins (each writes its shards). In the background: returns once the
        # arrays are copied off the device (the next step may donate them).
        background = not wait and self.peers is None
        self.checkpointer.save(key, state, metadata, wait=not background)
        self._key, self._key_step = key, at.step
        if background:
            self._saving = len(self.unacked)
        else:
            self.flush()
        # the time the learner was held: with a background save, the copy off the device
        self.metrics.observe("learner/checkpoint_s", time.perf_counter() - start)

    def settle(self, wait: bool = False) -> None:
        """Acknowledges what the save in flight covers once its files are complete (`wait`:
        blocks until then); a no-op without one, or while it is still writing.

        Raises:
          Whatever Orbax raises for a save that failed (the learner fails: nothing it covers is
          acknowledged, so a resume trains it again).
        """
        if not self._saving or (not wait and self.checkpointer.saving()):
            return
        self.checkpointer.wait()
        covered, self._saving = self._saving, 0
        ids, self.unacked = self.unacked[:covered], self.unacked[covered:]
        self._ack(ids)

    def flush(self) -> None:
        """Acknowledges every entry handled (no save may be in flight)."""
        ids, self.unacked, self._saving = self.unacked, [], 0
        self._ack(ids)

    def _ack(self, ids: list[str]) -> None:
        if ids:
            self._report()  # admission hears first that these are no longer handled
            self.buffer.ack(ids)
            self.trained_ids.difference_update(ids)
            with self._held_lock:  # after the ack: the buffer hands these out no more
                self._held.difference_update(ids)

    def open(self, state) -> tuple[object, Position | None]:
        """Restores the latest checkpoint, if any, then begins the ledger. Returns the train
        state (restored, or `state` as given) and the restored position (None: a fresh run).

        Raises:
          ValueError: the checkpoint does not match this model and optimizer.
        """
        position = None
        if self.checkpointer is not None:
            state, position = self._restore(state)
        if self.ledger is not None:
            self.ledger.begin(self.restored_from)
        return state, position

    def _restore(self, state) -> tuple[object, Position | None]:
        key = self.checkpointer.latest_step()
        if key is None:
            return state, None
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        state, metadata = self.checkpointer.restore(abstract, key)
        at = Position(int(metadata["learner_step"]), int(metadata["weights_version"]),
                      int(metadata["since_publish"]))
        self.trained_ids = set(metadata["unacked"])  # every process's: skipped if redelivered
        hosts = metadata.get("hosts")
        processes, index = jax.process_count(), jax.process_index()
        if hosts is not None and len(hosts) == processes:
            counters = hosts[index]["counters"]
        else:  # written by another number of processes: process 0 carries the totals
            counters = metadata["counters"] if index == 0 else {}
        for name, value in counters.items():
            self.metrics.count(name, value)
        self._key, self._key_step, self.step = key, at.step, at.step
        self.restored_from = key
        log.warning("restored checkpoint %d: learner step %d, version %d; %d entries it covers "
                    "are skipped if redelivered", key, at.step, at.version, len(self.trained_ids))
        return state, at
