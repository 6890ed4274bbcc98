"""Redis connections that fail fast, and the retry with backoff every Redis client here uses.

A client from `connect` keeps no retry policy of its own (redis-py's would hide lost connections
and count nothing); callers wrap each request in `call_with_retry`, which retries a lost
connection with exponential backoff for a bounded time, logs each retry, and then raises the
caller's error type with the reason. A refused password is never retried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)

_T = TypeVar("_T")


def connect(url: str, password: str | None, socket_timeout_s: float) -> redis.Redis:
    """A client that fails fast on a lost connection: callers retry with their own backoff."""
    return redis.Redis.from_url(
        url, password=password or None, socket_timeout=socket_timeout_s,
        socket_connect_timeout=min(5.0, socket_timeout_s), retry=Retry(NoBackoff(), 0))


def call_with_retry(fn: Callable[[], _T], *, where: str, what: str, retry_s: float,
                    error: type[Exception], on_retry: Callable[[], None] | None = None,
                    auth_hint: str = "", lost_hint: str = "") -> _T:
    """Runs `fn`, retrying a lost connection with exponential backoff (0.05 s doubling to 2 s)
    for at most `retry_s`; then, or on a refused password, raises `error` with the reason."""
    start, delay, retries = time.monotonic(), 0.05, 0
    while True:
        try:
            return fn()
        except redis.AuthenticationError as exc:
            raise error(f"Redis at {where} refused authentication during {what} ({exc}); "
                        f"{auth_hint}") from None
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            elapsed = time.monotonic() - start
            if elapsed + delay > retry_s:
                raise error(f"lost the connection to Redis at {where} during {what} and gave "
                            f"up after {retries} retries over {elapsed:.1f} s: {exc}. "
                            f"{lost_hint}") from exc
            retries += 1
            if on_retry is not None:
                on_retry()
            log.warning("Redis %s at %s failed (%s); retry %d in %.2f s", what, where, exc,
                        retries, delay)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
