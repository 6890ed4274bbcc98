"""Waiting for admission (`headrace.buffer.admission`): the blocking `admit`, the asyncio
`wait_admit` (both poll the store with a doubling interval) and `Heartbeat`, which renews an
actor's leases on a thread."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from headrace.buffer.admission import REFUSED_LAG, Admission, Forecast, Lease, _check_request, check_name

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Admitted:
    """How a wait for admission ended: `lease` is None when stopped or timed out."""

    lease: Lease | None
    wait_s: float  # report as actor/admission_wait_s
    attempts: int
    last: Forecast | None  # the last refusal's forecast (None when admitted at once)
    more: tuple[Lease, ...] = ()  # leases for other groups, when more than one was asked for


class _Waiter:
    """The polling state both helpers share: `attempt()` is an `Admitted` or a delay to sleep."""

    def __init__(self, admission: Admission, actor_id: str,
                 weights_version: int | Callable[[], int],
                 p90_episode_s: float | None | Callable[[], float | None],
                 poll_s: float, max_poll_s: float, timeout_s: float | None,
                 count: int | Callable[[], int] = 1, woken_for_lag: bool = False):
        if not 0 < poll_s <= max_poll_s:
            raise ValueError(f"poll_s={poll_s}, max_poll_s={max_poll_s}: need 0 < poll_s <= "
                             "max_poll_s")
        check_name("actor_id", actor_id)
        self.admission, self.actor_id = admission, actor_id
        self._version = weights_version if callable(weights_version) else lambda: weights_version
        self._p90 = p90_episode_s if callable(p90_episode_s) else lambda: p90_episode_s
        self._count = count if callable(count) else lambda: count
        self._delay, self._max_poll_s = poll_s, max_poll_s
        self.start = time.monotonic()
        self._deadline = None if timeout_s is None else self.start + timeout_s
        self.attempts, self.last = 0, None
        self._woken_for_lag = woken_for_lag  # a lag refusal waits for the wake, max_poll_s at most

    def attempt(self) -> Admitted | float:
        self.attempts += 1
        version, p90 = self._version(), self._p90()
        _check_request(version, p90)
        count = max(1, self._count())
        forecast, leases = self.admission._decide(self.actor_id, version, p90, True, count)
        if leases:
            return Admitted(leases[0], time.monotonic() - self.start, self.attempts, self.last,
                            tuple(leases[1:]))
        self.last = forecast
        now = time.monotonic()
        if self._deadline is not None and now >= self._deadline:
            return self.give_up()
        if self._woken_for_lag and forecast.reason == REFUSED_LAG:
            delay = self._max_poll_s
        else:
            delay, self._delay = self._delay, min(self._delay * 2, self._max_poll_s)
        return delay if self._deadline is None else min(delay, self._deadline - now)

    def give_up(self) -> Admitted:
        return Admitted(None, time.monotonic() - self.start, self.attempts, self.last)


def admit(admission: Admission, actor_id: str, weights_version: int | Callable[[], int], *,
          stop: threading.Event, p90_episode_s: float | None | Callable[[], float | None] = None,
          poll_s: float = 0.05, max_poll_s: float = 0.5,
          timeout_s: float | None = None) -> Admitted:
    """Blocks until admitted, `stop` is set or `timeout_s` passes.

    Polls `try_admit`, the interval doubling from `poll_s` to `max_poll_s`; `weights_version` and
    `p90_episode_s` may be callables, re-read on every attempt (the actor may pick up newer weights
    while it waits). A stop wakes the wait at once.
    Raises:
      AdmissionError: the store became unreachable.
    """
    waiter = _Waiter(admission, actor_id, weights_version, p90_episode_s, poll_s, max_poll_s,
                     timeout_s)
    while not stop.is_set():
        result = waiter.attempt()
        if isinstance(result, Admitted):
            return result
        stop.wait(result)
    return waiter.give_up()


async def wait_admit(admission: Admission, actor_id: str,
                     weights_version: int | Callable[[], int], *, stop: threading.Event,
                     p90_episode_s: float | None | Callable[[], float | None] = None,
                     poll_s: float = 0.05, max_poll_s: float = 0.5,
                     timeout_s: float | None = None,
                     count: int | Callable[[], int] = 1,
                     wake: asyncio.Event | None = None) -> Admitted:
    """`admit` for an asyncio loop: sleeps with `asyncio.sleep` (a stop is seen within
    `max_poll_s`). Each attempt is one short blocking store call (a Redis round trip) that asks
    for `count` leases (a callable: re-read on every attempt): once one is admissible it returns
    the first as `lease` and any others as `more`.

    `wake`, when given, is set by whoever changes what the forecast depends on (the actor: new
    weights installed; a lag refusal lifts only then, as the learner's steps leave
    `trained_at` unchanged for given weights): it ends a sleep at once, and a lag refusal then
    waits for it (or `max_poll_s`, for what else lifts one: groups dropped or expired) instead
    of polling sooner. It is cleared before every attempt, so a change during one is not missed.
    """
    waiter = _Waiter(admission, actor_id, weights_version, p90_episode_s, poll_s, max_poll_s,
                     timeout_s, count, woken_for_lag=wake is not None)
    while not stop.is_set():
        if wake is not None:
            wake.clear()
        result = waiter.attempt()
        if isinstance(result, Admitted):
            return result
        if wake is None:
            await asyncio.sleep(result)
            continue
        try:
            await asyncio.wait_for(wake.wait(), result)
        except TimeoutError:
            pass
    return waiter.give_up()


class Heartbeat:
    """Renews one actor's leases every `every_s` (default `lease_ttl_s / 3`) on a daemon thread.

    A failed renewal is logged and counted (`failures`, `last_error`) and retried at the next beat;
    if failures last longer than the TTL the leases expire, which is the designed outcome.
    Use as a context manager, or `start()` / `stop()`.
    """

    def __init__(self, admission: Admission, actor_id: str, every_s: float | None = None):
        self.admission, self.actor_id = admission, check_name("actor_id", actor_id)
        self.every_s = admission.lease_ttl_s / 3 if every_s is None else every_s
        if not 0 < self.every_s:
            raise ValueError(f"every_s={every_s}: must be > 0")
        self.beats = self.failures = 0
        self.last_error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{actor_id}-heartbeat",
                                        daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.admission.heartbeat(self.actor_id)
                self.beats += 1
            except Exception as error:  # counted and logged; the leases may lapse
                self.failures += 1
                self.last_error = error
                log.warning("heartbeat of %s failed (%d so far): %s", self.actor_id,
                            self.failures, error)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
