"""Admission control (docs/design.md, "Admission"): an actor starts a group only if it would be trained
within the lag limit.

The forecast. With the learner at version `v`, `s` steps since its last publish, `Q` groups ahead of
the new one (the new one included), consumption in arrival order, `groups_per_batch` groups per
learner step and a publish every `publish_every` steps, the new group is trained at
(`headrace.versions.trained_at_version`, the one home of the formula)

    trained_at = v + floor((s + ceil(Q / groups_per_batch) - 1) / publish_every)

and an actor holding weights `v_a` may start it when `trained_at - v_a <= max_policy_lag`. When
`max_age_s` is set and the actor knows its p90 episode time, admission also requires
`ceil(Q / groups_per_batch) * step_s + p90_episode_s <= max_age_s` (the learner's gate drops groups
older than `max_age_s`; `step_s` is the learner's recent time per step). When `max_ready_batches` is
set, and the p90 episode time and `step_s` are known, admission also requires
`ceil(Q / groups_per_batch) * step_s <= p90_episode_s + max_ready_batches * step_s`: when the new
group is done, at most `max_ready_batches` batches are still ahead of it, unless a learner process
waits for data that is not coming (below). The lag limit alone caps
what is in flight plus what is ready, so a pool larger than the learner needs fills that window to
the limit and its surplus waits in the queue, aging; this cap follows the episode time in learner
steps instead (L/S), so groups train at about L/S + `max_ready_batches` versions and the surplus
waits unstarted. It counts the groups in flight, so it reacts at once: a cap on the finished groups
alone would react an episode late and swing between a flooded and an empty queue (measured).

The cap never starves a waiting learner. `Q` counts what every learner process holds; with
several, one can hold its reader queue full and its share of the next batch (waiting for the
others in a collective) while another waits for its share, and `Q` alone would then refuse for
good: a hang. So each process reports the groups it is blocked waiting for
(`learner_update(waiting_for=...)`, summed over hosts), and the cap admits while the groups coming
(`depth + in_flight`, this call's admitted ones included) are fewer than that, so no more than the
waiting processes lack. With one learner process this would change no decision (waiting, it holds
less than a batch, so with fewer groups coming than it lacks `Q` is at most one batch, which the
cap never refuses), so a lone process does not report it.

What `Q` counts, and who reports it:
  * `learner queued`: groups the learner has read from the buffer but not yet trained (reader,
    queue, the batch being built or trained): the buffer's pending entries (delivered, not yet
    acknowledged) minus those the learner reports as handled (trained, dropped or skipped, waiting
    for acknowledgement; `learner_update(handled=...)`, one figure per learner `host`, summed).
    Pending and depth are read together, so an entry the learner has just read is counted at
    once. The learner reports a batch as handled only after its step, and stops reporting entries
    before it acknowledges them: every stale report over-counts, which only makes admission
    conservative.
  * `depth`: undelivered groups in the buffer. Both are read by the backend itself at decision
    time (the in-process backend calls the `counts` callable it was given, e.g.
    `MemoryBuffer.counts`; the Redis backend reads the run's stream, `XLEN` and the group's
    pending count, inside its script).
  * `in_flight`: live leases, one per admitted group not yet released.
  * `+ 1`: the new group.

Protocol for an actor (the waiting helpers are in `headrace.buffer.admission_wait`): `try_admit`
(or the blocking `admit` / `wait_admit`) before starting a group, or `try_admit_many`
(`wait_admit(count=...)`) for several groups in one round trip; renew the leases with
`heartbeat(actor_id)` every `lease_ttl_s / 3` or so (`Heartbeat` does it on a thread);
`release(lease)` once the group is in the buffer (after the put returns, so the group is never
counted by neither side; briefly counting it twice only makes admission conservative), and in a
`finally` when the group is abandoned. The learner calls `learner_update` after every read and
every step.

It is a forecast, not a guarantee: episodes finish out of order, and the gate drops (and counts)
whatever turns out over a limit. Failure modes: a crashed actor stops heartbeating, so its leases
expire after `lease_ttl_s` and admission resumes without it (its groups, if they ever arrive, are
still trained or dropped by the gate). A heartbeat renews every lease of its `actor_id`, so an actor
process names its leases for itself alone (`Actor.lease_owner`: its id and a token of its own); a
restarted actor under the same id would otherwise keep its predecessor's leases alive for good,
counted in flight with nothing coming. An actor that stalls longer than `lease_ttl_s` loses its
leases too (`heartbeat` returns how many it renewed; `release` of an expired lease returns False).
"""

from __future__ import annotations

import abc
import dataclasses
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from headrace.config import Config
from headrace.versions import batches_for, too_many_ready, trained_at_version

_NAME = re.compile(r"^[\w.\-:]+$")
REFUSED_LAG = "lag"  # the group would be trained more than max_policy_lag versions past the weights
REFUSED_AGE = "age"  # expected wait + p90 episode time would exceed max_age_s
REFUSED_READY = "ready"  # more than max_ready_batches batches would be ahead when it is done


class AdmissionError(RuntimeError):
    """The admission store cannot serve a request (connection lost for good)."""


def check_name(what: str, value: str) -> str:
    """`value` if it is a usable actor or host name (letters, digits, `_ . - :`).

    Raises:
      ValueError: it is empty or holds other characters.
    """
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"{what}={value!r}: use letters, digits, '_', '.', '-', ':'")
    return value


@dataclasses.dataclass(frozen=True)
class AdmissionLimits:
    """The settings the forecast needs; `from_config` takes them from the run's config."""

    groups_per_batch: int  # groups one learner step consumes
    publish_every: int  # learner steps between weight publishes
    max_policy_lag: int  # largest admissible trained_at - weights version
    max_age_s: float = 0.0  # largest admissible expected wait + p90 episode time (0: off)
    max_ready_batches: int = 0  # most batches ahead of a group when it is done (0: off)

    def __post_init__(self):
        for name in ("groups_per_batch", "publish_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.max_policy_lag < 0 or self.max_age_s < 0 or self.max_ready_batches < 0:
            raise ValueError(f"max_policy_lag={self.max_policy_lag}, max_age_s="
                             f"{self.max_age_s} and max_ready_batches="
                             f"{self.max_ready_batches}: must be >= 0")

    @classmethod
    def from_config(cls, config: Config) -> AdmissionLimits:
        """The run's limits; `run.mode: sync` is lag 0 with a publish after every step, so
        actors generate exactly one batch at the learner's current version, then wait (the
        ready cap is off: the lag already holds them to one batch)."""
        sync = config.run.mode == "sync"
        return cls(groups_per_batch=config.learner.groups_per_batch,
                   publish_every=1 if sync else config.learner.publish_every,
                   max_policy_lag=0 if sync else config.staleness.max_policy_lag,
                   max_age_s=config.staleness.max_age_s,
                   max_ready_batches=0 if sync else config.staleness.max_ready_batches)


@dataclasses.dataclass(frozen=True)
class LearnerState:
    """What the learner last reported (all zero before its first `learner_update`)."""

    version: int = 0  # latest published policy version
    since_publish: int = 0  # learner steps since that publish
    queued: int = 0  # groups read from the buffer, not yet trained (all hosts): pending - handled
    step_s: float = 0.0  # recent seconds per learner step (0: unknown)
    waiting_for: int = 0  # groups learner processes are blocked waiting for (all hosts)


@dataclasses.dataclass(frozen=True)
class Forecast:
    """One admission decision and everything it was computed from."""

    version: int
    since_publish: int
    learner_queued: int
    depth: int
    in_flight: int  # live leases before this request
    queued_ahead: int  # Q: learner_queued + depth + in_flight + 1
    batches: int  # ceil(Q / groups_per_batch)
    trained_at: int
    weights_version: int
    lag: int  # trained_at - weights_version
    expected_wait_s: float  # batches * step_s
    p90_episode_s: float | None
    reason: str  # "" (admissible), REFUSED_LAG, REFUSED_READY or REFUSED_AGE

    @property
    def admitted(self) -> bool:
        return not self.reason

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"admitted": self.admitted}


@dataclasses.dataclass(frozen=True)
class Lease:
    """A reserved in-flight slot; valid while its actor heartbeats, until released."""

    lease_id: str
    actor_id: str
    weights_version: int
    trained_at: int  # forecast version the group is trained at
    queued_ahead: int  # Q when admitted


def decide(state: LearnerState, depth: int, in_flight: int, limits: AdmissionLimits,
           weights_version: int, p90_episode_s: float | None) -> Forecast:
    """The admission rule as a pure function (the Redis script mirrors it; tests compare them)."""
    ahead = state.queued + depth + in_flight + 1
    batches = batches_for(ahead, limits.groups_per_batch)
    trained_at = trained_at_version(state.version, state.since_publish, ahead,
                                    limits.groups_per_batch, limits.publish_every)
    wait_s = batches * state.step_s
    reason = ""
    if trained_at - weights_version > limits.max_policy_lag:
        reason = REFUSED_LAG
    elif (too_many_ready(batches, state.step_s, p90_episode_s, limits.max_ready_batches)
          and depth + in_flight >= state.waiting_for):  # else a waiting learner lacks them
        reason = REFUSED_READY
    elif (limits.max_age_s > 0 and p90_episode_s is not None
          and wait_s + p90_episode_s > limits.max_age_s):
        reason = REFUSED_AGE
    return Forecast(state.version, state.since_publish, state.queued, depth, in_flight, ahead,
                    batches, trained_at, weights_version, trained_at - weights_version, wait_s,
                    p90_episode_s, reason)


def grant(actor_id: str, state: LearnerState, depth: int, in_flight: int,
          limits: AdmissionLimits, weights_version: int, p90_episode_s: float | None,
          lease_ids: list[str]) -> tuple[Forecast, list[Lease]]:
    """The rule applied to `len(lease_ids)` groups in turn, each admitted one in flight for the
    next, up to the first refusal: the leases of the admitted ones and the last decision's
    forecast (with no ids: the forecast for one group, and no lease). Admission is monotone in
    the groups ahead, so no group after a refusal could be admitted."""
    forecast, leases = decide(state, depth, in_flight, limits, weights_version, p90_episode_s), []
    for lease_id in lease_ids:
        if leases:
            forecast = decide(state, depth, in_flight + len(leases), limits, weights_version,
                              p90_episode_s)
        if not forecast.admitted:
            break
        leases.append(Lease(lease_id, actor_id, weights_version, forecast.trained_at,
                            forecast.queued_ahead))
    return forecast, leases


def check_update(version: int, since_publish: int, handled: int, step_s: float,
                 waiting_for: int) -> None:
    """Raises ValueError when a learner report is out of range."""
    if version < 0 or since_publish < 0 or handled < 0 or not step_s >= 0 or waiting_for < 0:
        raise ValueError(f"learner_update(version={version}, since_publish={since_publish}, "
                         f"handled={handled}, step_s={step_s}, waiting_for={waiting_for}): all "
                         "must be >= 0")


def new_lease_id(actor_id: str) -> str:
    return f"{actor_id}|{uuid.uuid4().hex[:16]}"


class Admission(abc.ABC):
    """Admission control shared by actors (and fed by the learner); every method is thread-safe.

    Args (of every backend):
      limits: the forecast's settings.
      lease_ttl_s: a lease not renewed by a heartbeat for this long expires.
    """

    def __init__(self, limits: AdmissionLimits, lease_ttl_s: float):
        if not lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s={lease_ttl_s}: must be > 0")
        self.limits, self.lease_ttl_s = limits, lease_ttl_s

    @abc.abstractmethod
    def learner_update(self, version: int, since_publish: int, handled: int, step_s: float,
                       host: str = "0", waiting_for: int = 0) -> None:
        """Records the learner's state: `handled` is this `host`'s groups handled but not yet
        acknowledged, `waiting_for` the groups it is blocked waiting for (0: it is not waiting).

        Raises:
          ValueError: a value is negative or `host` is not a name.
        """

    @abc.abstractmethod
    def _decide(self, actor_id: str, weights_version: int, p90_episode_s: float | None,
                reserve: bool, count: int = 1) -> tuple[Forecast, list[Lease]]:
        """Forecasts, and when `reserve` takes a lease for each of up to `count` groups that
        are admissible in turn (`grant`), in one atomic step."""

    @abc.abstractmethod
    def release(self, lease: Lease) -> bool:
        """Frees the lease's slot; False when it had already expired or been released."""

    def release_many(self, leases: Sequence[Lease]) -> int:
        """Frees every lease's slot (the Redis backend: one round trip for one actor's leases);
        returns how many were live."""
        return sum(self.release(lease) for lease in leases)

    @abc.abstractmethod
    def heartbeat(self, actor_id: str) -> int:
        """Extends every live lease of `actor_id` to now + `lease_ttl_s`; returns how many."""

    @abc.abstractmethod
    def in_flight(self, actor_id: str | None = None) -> int:
        """Live leases (of one actor, or of all)."""

    @abc.abstractmethod
    def learner_state(self) -> LearnerState:
        """What the learner last reported (zeros before its first report)."""

    def close(self) -> None:  # noqa: B027 - only backends with connections override it
        """Releases connections; leases stay until released or expired."""

    def try_admit(self, actor_id: str, weights_version: int,
                  p90_episode_s: float | None = None) -> Lease | None:
        """A lease when a group started now with weights `weights_version` is admissible, else None.

        `p90_episode_s` (None: not known yet) enables the `max_age_s` check.
        Raises:
          ValueError: `actor_id` is not a name, or a number is negative.
          AdmissionError: the store is unreachable (Redis backend).
        """
        leases = self.try_admit_many(actor_id, weights_version, 1, p90_episode_s)
        return leases[0] if leases else None

    def try_admit_many(self, actor_id: str, weights_version: int, count: int,
                       p90_episode_s: float | None = None) -> list[Lease]:
        """Leases for up to `count` groups started now with weights `weights_version`: as many
        as are admissible one after another (the first refusal ends it), in one atomic step (one
        round trip for the Redis backend). Raises as `try_admit`, and ValueError for a count < 1.
        """
        check_name("actor_id", actor_id)
        _check_request(weights_version, p90_episode_s)
        if count < 1:
            raise ValueError(f"count={count}: must be >= 1")
        return self._decide(actor_id, weights_version, p90_episode_s, True, count)[1]

    def forecast(self, weights_version: int, p90_episode_s: float | None = None) -> Forecast:
        """What `try_admit` would decide now, without reserving anything."""
        _check_request(weights_version, p90_episode_s)
        return self._decide("forecast", weights_version, p90_episode_s, False)[0]


def _check_request(weights_version: int, p90_episode_s: float | None) -> None:
    if weights_version < 0 or (p90_episode_s is not None and not p90_episode_s >= 0):
        raise ValueError(f"weights_version={weights_version}, p90_episode_s={p90_episode_s}: "
                         "must be >= 0")


class InProcessAdmission(Admission):
    """Admission for the threads launcher: one lock, leases in a dict.

    Args:
      limits, lease_ttl_s: see `Admission`.
      counts: returns the buffer's (undelivered, pending) groups, read together (e.g.
        `MemoryBuffer.counts`); None counts 0 and 0. It is called under this object's lock, so it
        must not call back into admission.
      clock: monotonic seconds (tests may pass a fake).
    """

    def __init__(self, limits: AdmissionLimits, *,
                 counts: Callable[[], tuple[int, int]] | None = None,
                 lease_ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        super().__init__(limits, lease_ttl_s)
        self._counts = counts or (lambda: (0, 0))
        self._clock = clock
        self._lock = threading.Lock()
        self._state = LearnerState()  # as reported; `queued` is read in `_read`
        self._handled: dict[str, int] = {}
        self._waiting: dict[str, int] = {}
        self._leases: dict[str, tuple[str, float]] = {}  # lease id -> (actor id, expiry)

    def _expire(self) -> float:
        now = self._clock()
        for lease_id in [k for k, (_, expiry) in self._leases.items() if expiry <= now]:
            del self._leases[lease_id]
        return now

    def learner_update(self, version: int, since_publish: int, handled: int, step_s: float,
                       host: str = "0", waiting_for: int = 0) -> None:
        check_update(version, since_publish, handled, step_s, waiting_for)
        check_name("host", host)
        with self._lock:
            self._handled[host] = handled
            self._waiting[host] = waiting_for
            self._state = LearnerState(version, since_publish, 0, float(step_s))

    def _read(self) -> tuple[LearnerState, int]:
        """The learner's state (queued: pending - handled; waiting_for: all hosts') and the
        depth; under the lock."""
        depth, pending = self._counts()
        queued = max(0, pending - sum(self._handled.values()))
        return dataclasses.replace(self._state, queued=queued,
                                   waiting_for=sum(self._waiting.values())), depth

    def learner_state(self) -> LearnerState:
        """What the learner last reported, with the groups it holds untrained (zeros before
        its first report)."""
        with self._lock:
            return self._read()[0]

    def _decide(self, actor_id: str, weights_version: int, p90_episode_s: float | None,
                reserve: bool, count: int = 1) -> tuple[Forecast, list[Lease]]:
        ids = [new_lease_id(actor_id) for _ in range(count)] if reserve else []
        with self._lock:
            now = self._expire()
            state, depth = self._read()
            forecast, leases = grant(actor_id, state, depth, len(self._leases), self.limits,
                                     weights_version, p90_episode_s, ids)
            for lease in leases:
                self._leases[lease.lease_id] = (actor_id, now + self.lease_ttl_s)
        return forecast, leases

    def release(self, lease: Lease) -> bool:
        with self._lock:
            self._expire()
            return self._leases.pop(lease.lease_id, None) is not None

    def heartbeat(self, actor_id: str) -> int:
        with self._lock:
            now = self._expire()
            mine = [k for k, (actor, _) in self._leases.items() if actor == actor_id]
            for lease_id in mine:
                self._leases[lease_id] = (actor_id, now + self.lease_ttl_s)
            return len(mine)

    def in_flight(self, actor_id: str | None = None) -> int:
        with self._lock:
            self._expire()
            if actor_id is None:
                return len(self._leases)
            return sum(actor == actor_id for actor, _ in self._leases.values())
