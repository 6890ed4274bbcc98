"""One side of a run alone, for Slurm, Kubernetes or by hand (docs/cluster.md).

`headrace learner CONFIG` is the processes launcher without actor processes
(`processes.train(..., standalone=True)`): it owns the run folder, the embedded Redis (bound to
`buffer.host`, on `buffer.port`) or the one `buffer.url` names, the learner process(es), the
weight store, checkpoints, evaluation and the summary. Once version 0 is published it announces
the run in Redis:

  headrace:standalone:latest       the run id of the newest standalone learner on this server
  headrace:{RUN:0}:standalone      hash: `weights` (the directory store's absolute path, or
                                   `redis:NAMESPACE` for the Redis store on the buffer's
                                   server or `weights.url`), `state` (running | ended),
                                   `started` (unix time)

`headrace actor CONFIG --connect URL` (URL: shorthand for `buffer.url`) is one actor process: it
reads the run id (or takes `--run-id`) and the weight store's location (unless `weights.path`
says it; for `weights.backend: redis` its namespace, on `weights.url` or else the buffer's server)
from that announcement, waits for it if the learner is not up yet, plays episodes into
the shard its name hashes to, and stops when the run is marked ended (or on SIGTERM / Ctrl-C).
Start as many as the learner can use, anywhere that reaches the buffer and the weight store.

The password never travels in argv, a URL or a log: both sides read it from
$HEADRACE_REDIS_PASSWORD (or `buffer.password` in a private config). The learner's embedded server
makes it the client user's password, so a learner with an embedded server needs it set, or its
actors could not connect.

Failure modes: an actor whose learner never announces gives up after `wait_s` with a clear error;
an actor whose connection is lost retries as every Redis client does (`redis_client`), then exits
non-zero (restart it: it rejoins the run; its in-flight reservations expire). A learner that
crashes leaves `state: running`: its actors keep waiting on admission until they are stopped.
`headrace learner --resume RUN_DIR` continues it (same run id, same Redis, from the latest
checkpoint) and announces it again; actors join it as before (docs/cluster.md).

This module is the announcement both sides share; the two commands are
`headrace.runtime.standalone_launch`.
"""

from __future__ import annotations

import logging
import pathlib
import socket
import threading
import time

import redis

from headrace.config import Config

log = logging.getLogger(__name__)

LATEST_KEY = "headrace:standalone:latest"
POLL_S = 1.0  # how often an actor looks for the run's end
REDIS_WEIGHTS = "redis:"  # an announced `weights` of the Redis store: redis:NAMESPACE
_WILDCARD = ("0.0.0.0", "::", "")


def run_key(run_id: str) -> str:
    return f"headrace:{{{run_id}:0}}:standalone"


def announce(client: redis.Redis, run_id: str, weights, url: str, config: Config) -> None:
    """Records the run for actors (the module docstring) and tells the user, on stderr, how to
    start them (the URL never carries a password)."""
    path = (f"{REDIS_WEIGHTS}{weights.namespace}" if config.weights.backend == "redis"
            else str(pathlib.Path(weights.root).absolute()))
    pipe = client.pipeline(transaction=True)
    pipe.hset(run_key(run_id), mapping={"weights": path, "state": "running",
                                        "started": repr(time.time())})
    pipe.set(LATEST_KEY, run_id)
    pipe.execute()
    shown = connect_url(url, config.buffer.host)
    log.warning("learner ready (run %s): start actors with\n  HEADRACE_REDIS_PASSWORD=... "
                "headrace actor CONFIG --connect %s\nweights: %s", run_id, shown, path)


def connect_url(url: str, host: str, address: str | None = None) -> str:
    """The URL actors on other machines use: a wildcard bind address `host` becomes `address`
    (by default this machine's name)."""
    if host in _WILDCARD:
        address = address or socket.getfqdn()
        return url.replace(f"@{host}:", f"@{address}:").replace(f"//{host}:", f"//{address}:")
    return url


def mark_ended(client: redis.Redis, run_id: str) -> None:
    """Tells the run's actors to stop (best effort: a lost server stops them anyway)."""
    try:
        client.hset(run_key(run_id), "state", "ended")
    except redis.RedisError as error:
        log.warning("could not mark run %s ended for its actors: %s", run_id, error)


def watch_end(client: redis.Redis, run_id: str, stop: threading.Event) -> threading.Thread:
    """Sets `stop` once the run is marked ended (polled every POLL_S on a daemon thread). A
    failed poll is skipped: the actor's own calls report a lost server."""

    def watch() -> None:
        while not stop.wait(POLL_S):
            try:
                state = client.hget(run_key(run_id), "state")
            except redis.RedisError:
                continue
            if state in (b"ended", "ended"):
                log.warning("the run %s ended; stopping", run_id)
                stop.set()

    thread = threading.Thread(target=watch, name="run-end", daemon=True)
    thread.start()
    return thread
