"""`headrace learner CONFIG` and `headrace actor CONFIG --connect URL`: one side of a run alone
(what each does, the announcement they share and their failure modes: `headrace.runtime.standalone`,
docs/cluster.md)."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import time

import redis

from headrace import config as config_lib
from headrace import placement
from headrace.config import Config, ConfigError
from headrace.runtime import build, standalone, worker


def learner(config: Config, *, live: bool = True, resume_dir=None,
            t0: float | None = None) -> dict:
    """`headrace learner CONFIG` (or `--resume RUN_DIR`, `config` from its config.yaml): the
    summary of the run (also in RUN_DIR/summary.json). A resumed run is announced again, under
    its own run id, so actors join it as they joined it first.

    Raises:
      ConfigError: the config cannot run this way (see `check_learner`), or the folder cannot
        be resumed.
    """
    from headrace.runtime.processes import train

    check_learner(config)
    return train(config, live=live, standalone=True, resume_dir=resume_dir, t0=t0)


def check_learner(config: Config) -> None:
    if config.run.launcher != "processes":
        raise ConfigError(f"run.launcher={config.run.launcher!r}: headrace learner runs the "
                          "processes launcher's learner side; leave run.launcher out")
    if not config.buffer.url and not config.buffer.urls and not build.buffer_password(config):
        raise ConfigError(f"headrace learner with an embedded redis-server needs the password "
                          f"its actors will use: set {build.PASSWORD_ENV} (in this shell and "
                          "the actors'), or give buffer.url of a server you run")


def actor(config: Config, *, connect: str = "", run_id: str = "", name: str = "",
          wait_s: float = 300.0) -> None:
    """`headrace actor CONFIG --connect URL`: one actor process, until the run ends.

    Raises:
      ConfigError: no buffer URL, a password in the URL, `run.actor_cpus` this machine lacks,
        or no learner announced within `wait_s`.
    """
    for what, value in (("--name", name), ("--run-id", run_id)):
        if value and not re.fullmatch(r"[\w.\-]+", value):
            raise ConfigError(f"{what} {value!r}: use letters, digits, '_', '-', '.'")
    if connect:
        config = config_lib.replace(config, buffer={"url": connect})
    b = config.buffer
    if not b.url and not b.urls:
        raise ConfigError("headrace actor needs the buffer's address: --connect "
                          "redis://[headrace@]HOST:PORT/0 (the learner prints it) or buffer.url")
    placement.check(config.run, ("actor_cpus",))  # the learner's CPUs are another machine's
    url = b.shard_url(0)
    password = build.buffer_password(config)
    client = redis.Redis.from_url(url, password=password or None, socket_timeout=10.0)
    try:
        run_id = run_id or _wait_for_run(client, url, wait_s)
        announced = "" if config.weights.path else _announced_weights(client, run_id, url)
    finally:
        client.close()
    config = config_lib.replace(config, weights=_weights_at(config, announced, url))
    name = name or f"actor-{socket.gethostname()}-{os.getpid()}"
    index = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "big") % 10**6
    data = build.without_secrets(config).to_dict()  # the password stays in the environment
    with build.password_for_children(config):
        worker.actor_main(data, "", url, run_id, index, tuple(config.run.actor_cpus), name=name)


def _wait_for_run(client: redis.Redis, url: str, wait_s: float) -> str:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            run_id = client.get(standalone.LATEST_KEY)
        except redis.AuthenticationError as error:
            raise ConfigError(f"Redis at {url} refused the password ({error}): set "
                              f"{build.PASSWORD_ENV} to the learner's") from None
        except redis.RedisError as error:
            run_id, last = None, error
        else:
            last = None
        if run_id:
            return run_id.decode()
        if time.monotonic() >= deadline:
            why = f" (last error: {last})" if last else ""
            raise ConfigError(f"no headrace learner announced a run at {url} within "
                              f"{wait_s:.0f} s{why}; start `headrace learner CONFIG` first, or "
                              "pass --run-id")
        time.sleep(0.5)


def _weights_at(config: Config, announced: str, url: str) -> dict:
    """The `weights` settings that find the learner's store: its directory, or the Redis store's
    namespace (on `weights.url`, else the buffer's server `url`).

    Raises:
      ConfigError: the learner's store is not the one this actor's config names.
    """
    if not announced:
        return {}  # weights.path given: the directory store there
    redis_store = announced.startswith(standalone.REDIS_WEIGHTS)
    if redis_store != (config.weights.backend == "redis"):
        mine = config.weights.backend
        raise ConfigError(f"weights.backend={mine}: the learner publishes to "
                          f"{'a Redis' if redis_store else 'a directory'} weight store "
                          f"({announced}); give the actor the learner's weights.backend")
    if redis_store:
        return {"namespace": announced.removeprefix(standalone.REDIS_WEIGHTS),
                "url": config.weights.url or url}
    return {"path": announced}


def _announced_weights(client: redis.Redis, run_id: str, url: str) -> str:
    path = client.hget(standalone.run_key(run_id), "weights")
    if not path:
        raise ConfigError(f"run {run_id} at {url} announced no weight store: set weights.path "
                          "to the learner's weights directory")
    return path.decode()
