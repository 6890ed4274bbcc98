"""The learner's feed: reader thread -> staleness gate -> carry -> batches, with a look-ahead.

A reader thread pulls entries from the buffer into a bounded queue (decoding happens there, off
the training thread). `next` gathers this process's share of `groups_per_batch` entries that pass
the gate at the version their batch will be trained at; entries that passed but are not yet in a
batch are carried, and gated again when used (a later version may find them too old).
`look_ahead` gathers the next batch from what is queued already, without waiting, while the
device trains the current one, so batch building leaves the critical path.

What the feed admits (docs/design.md, "Invariants"): an entry its checkpoint covers is skipped
(`buffer/redelivered_skipped`); a group whose token ids reach past the model's vocabulary is
quarantined through the buffer (an embedding lookup out of range would turn the weights into
NaN); a group the gate refuses is dropped (counted by reason), and so, with
`learner.drop_uniform_groups`, is one whose rewards are all equal, up to a limit per batch
(`gate.UniformDrops`). Skips and drops are recorded in the book (`headrace.learner.book`), which
acknowledges them with the next checkpoint.

The feed decides nothing about checkpoints: when every pending entry the buffer allows is handled
but unacknowledged, `next` returns `STARVED` and the loop relieves it.

With several learner processes, while `next` blocks for want of entries `waiting_for` is what it
still lacks, and `report` (the loop's report to admission control) is called when that changes:
admission's ready cap counts what every learner process holds, so it must know when one of them
waits for what another holds (docs/design.md, "Admission"). A blocked `next` also reports when it
has dropped or skipped entries since the loop last reported: until admission hears of them it
counts them as queued for this process, and the cap could hold back the very groups it waits for
(a lone learner resumed after a crash, every redelivered group dropped for lag, waited for ever).
A lone process that blocks with nothing of that kind reports nothing (a round trip saved).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from headrace.buffer.base import Buffer
from headrace.buffer.serialize import MalformedEntry, check_tokens
from headrace.config import Config
from headrace.learner.batching import Batcher
from headrace.learner.book import Book
from headrace.learner.gate import StalenessGate, UniformDrops
from headrace.metrics.core import Metrics
from headrace.metrics.traces import Tracer
from headrace.types import Entry

log = logging.getLogger(__name__)

STARVED = "starved"  # `next`: nothing more comes until handled entries are acknowledged


class LearnerError(RuntimeError):
    """A part of the learner failed (reader, batch building, publishing); the message says which
    and why. The entries it handled since the last checkpoint are not acknowledged."""


class Feed:
    def __init__(self, config: Config, buffer: Buffer, batcher: Batcher, gate: StalenessGate,
                 book: Book, metrics: Metrics, tracer: Tracer, stop: threading.Event,
                 vocab_size: int, processes: int = 1,
                 report: Callable[[], None] = lambda: None):
        """`processes`: learner processes sharing each batch (this one gathers its share); with
        several, a batch gathered ahead is built later (building agrees shapes with the others,
        a collective that must run in step with theirs). `report`: called from the training
        thread when `waiting_for` changes (several processes only) and when a blocked `next`
        has handled entries the loop has not reported."""
        lc = config.learner
        self.config = config
        self.buffer = buffer
        self.batcher = batcher
        self.gate = gate
        self.book = book
        self.metrics = metrics
        self.tracer = tracer
        self.stop = stop
        self.vocab_size = vocab_size
        self.need = lc.groups_per_batch // processes
        self.uniform = UniformDrops.from_config(lc, self.need, metrics)  # None: none dropped
        self._build_ahead = processes == 1
        self._reports_waiting = processes > 1
        self.report = report
        self.waiting_for = 0  # entries a blocked `next` still lacks (0: not blocked)
        self._unreported = 0  # entries dropped or skipped since this feed last reported
        # Two of this process's shares: with several processes each reads about its own.
        self._queue: queue.Queue[Entry] = queue.Queue(maxsize=2 * self.need)
        self._carry: list[Entry] = []  # passed the gate, not yet in a batch (gated again on use)
        self._ahead: tuple[list[Entry], object] | None = None  # gathered while a step trained
        # The host time of the batch `next` gave last: its wait for data, its building.
        self.waited_s = self.built_s = 0.0
        self._handed = True  # `next` gave a batch last (the next call begins another)
        self._reader_stop = threading.Event()
        self._reader: threading.Thread | None = None
        self.error: BaseException | None = None  # the reader thread's failure, if any

    # --- the reader thread -------------------------------------------------------------------

    def start(self) -> None:
        self._reader = threading.Thread(target=self._read, name="learner-reader", daemon=True)
        self._reader.start()

    def close(self) -> None:
        """Stops the reader (read no more); what is queued stays unacknowledged."""
        self._reader_stop.set()
        if self._reader is not None:
            self._reader.join(timeout=5)

    def _read(self) -> None:
        try:
            while not (self.stop.is_set() or self._reader_stop.is_set()):
                room = self._queue.maxsize - self._queue.qsize()
                if room <= 0:
                    time.sleep(0.001)
                    continue
                entries, held = self.book.hold(self.buffer.get(room, timeout_s=0.1))
                if held:
                    self.metrics.count("buffer/redelivered_held", held)
                if entries:
                    self.tracer.read(entries)
                for entry in entries:
                    self._queue.put(entry)
        except Exception as error:  # raised by the learner's `run` once training stops
            log.exception("learner reader failed")
            self.error = error
            self.stop.set()

    # --- gathering ------------------------------------------------------------------------------

    def next(self, version: int):
        """The next batch's (entries, batch or None: not built yet), trained at `version`: the one
        gathered ahead, else gathered now (blocking). None once stopping; `STARVED` when the
        buffer hands out nothing more until handled entries are acknowledged (what passed is
        kept for the next call)."""
        if self._handed:  # a new batch: its own host time
            self.waited_s = self.built_s = 0.0
            self._handed = False
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            self._handed = True
            return ahead
        start = time.perf_counter()
        entries = self._gather(version, block=True)
        self.waited_s += time.perf_counter() - start  # summed over calls that found no batch
        if entries is None or entries is STARVED:
            return entries
        self._handed = True
        return entries, None

    @property
    def host_s(self) -> float:
        """The host time the batch `next` gave last took before its step: waiting, building."""
        return self.waited_s + self.built_s

    def look_ahead(self, version: int) -> None:
        """Gathers (and, one process, builds) the batch after this one from what is queued
        already, gated at `version`, the version it will be trained at; nothing when too little
        is queued (what passed is carried)."""
        entries = self._gather(version, block=False)
        if entries is not None:
            self._ahead = entries, self.build(entries) if self._build_ahead else None

    def put_back(self, got) -> None:
        """Returns what `next` gave, untrained, and anything gathered ahead, to the carry: gated
        again if ever used."""
        if self._ahead is not None:
            got, self._ahead = self._ahead, None
            self.put_back(got)
        if isinstance(got, tuple):
            self._carry = got[0] + self._carry

    def build(self, entries: list[Entry]):
        """The batch of `entries` (its time: `learner/batch_s`, `built_s`).

        Raises:
          LearnerError: building it failed."""
        start = time.perf_counter()
        try:
            batch = self.batcher.build([e.group for e in entries])
        except LearnerError:
            raise
        except Exception as error:
            raise LearnerError(f"building a batch failed after step {self.book.step}: "
                               f"{type(error).__name__}: {error}") from error
        self.built_s = time.perf_counter() - start
        self.metrics.observe("learner/batch_s", self.built_s)
        return batch

    def _gather(self, version: int, block: bool):
        """`need` entries that pass the gate at `version`. Blocking: waits for them; None once
        stopping, `STARVED` when starved. Not blocking: takes only what is queued already; None
        (keeping what passed for the next call) when that is not enough."""
        carried, self._carry = self._carry, []
        # gated again (a later version); what their rewards say was decided when they came
        entries = [e for e in carried if self._admit(e, version, carried=True)]
        while len(entries) < self.need:
            try:
                entry = self._queue.get(timeout=0.05) if block else self._queue.get_nowait()
            except queue.Empty:
                if not block or self.stop.is_set():
                    self._carry = entries
                    return self._waited(None)
                unacked = len(self.book.unacked)
                if unacked and unacked + len(entries) + self._queue.qsize() \
                        >= self.config.buffer.max_pending:
                    self._carry = entries
                    return self._waited(STARVED)
                self._wait(self.need - len(entries))
                continue
            if self._admit(entry, version):
                entries.append(entry)
        if self.uniform is not None:  # the next batch has its own limit
            self.uniform.next_step()
        return self._waited(entries)

    def _wait(self, lacking: int) -> None:
        """Blocked, lacking `lacking` entries: reported when that changed (several processes)
        or when entries were handled since the last report (see the module's docstring)."""
        if (self._reports_waiting and lacking != self.waiting_for) or self._unreported:
            self.waiting_for = lacking if self._reports_waiting else 0
            self._unreported = 0
            self.report()

    def _waited(self, got):
        """`got`, after telling admission that this process no longer waits."""
        if self._reports_waiting:
            self._wait(0)
        return got

    def _admit(self, entry: Entry, version: int, carried: bool = False) -> bool:
        """Whether `entry` goes into a batch trained at `version`; a skip or drop is recorded."""
        if entry.id in self.book.trained_ids:  # redelivered; a checkpoint already covers it
            self.metrics.count("buffer/redelivered_skipped")
            self.book.handled("skipped", [entry])
            self._unreported += 1
            return False
        try:
            check_tokens(entry.group, self.vocab_size)
        except MalformedEntry as error:  # moved aside by the buffer: counted there, never back
            self.buffer.quarantine(entry.id, error.reason, str(error))
            self.book.release(entry.id)
            return False
        reason = self.gate.check(entry.group, version)
        if reason is None and self.uniform is not None and not carried:
            reason = self.uniform.group(entry.group)
        if reason is not None:
            self.book.handled("dropped", [entry], reason)
            self._unreported += 1
            return False
        self.tracer.gated(entry)
        return True
