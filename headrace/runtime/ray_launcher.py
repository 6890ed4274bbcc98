"""The Ray launcher (`run.launcher: ray`, `pip install 'headrace[ray]'`): the processes launcher's
run, with the learner hosts and the actors as Ray actors placed on a cluster's nodes.

The driver (the `headrace train` process) joins the cluster `run.ray_address` names (else
$RAY_ADDRESS, else it starts a local one), then runs `processes.train` with `RaySupervisor` in
place of the local-process supervisor: the same buffer (the embedded redis-server on the driver's
node, or on the node `run.ray_buffer_bundle` reserves (`ray_buffer`), or `buffer.url`), weight
store, evaluation, live view, summary, Ctrl-C and errors; the same
learner and actor entry points (`worker`). No component knows which launcher runs it.

Placement: one placement group per run, `parallel.processes` learner bundles
(`run.ray_learner_bundle`, e.g. {GPU: 1} or a custom resource that names the learner's nodes)
followed by `actor.num_actors` actor bundles (`run.ray_actor_bundle`), laid out by
`run.ray_strategy`. Each learner host and each actor is one Ray actor (`Host`) that takes its
bundle's resources and runs the entry point in its own worker process. With more than one learner
host, host 0 picks the `jax.distributed` coordinator address (its node's IP, a free port).

Faults: an actor whose process or node dies is restarted by Ray (on a surviving node when its
bundle is rescheduled there: the placement group moves the bundles of a dead node to nodes with
room) and its loop is started again; a crash is counted in `actor/restarts`, and
`actor.max_restarts` crashes in a row (a run of HEALTHY_S resets the count) end the run, as under
the processes launcher. A learner host that dies or fails ends the run with its reason; the run
folder (on the driver's node) keeps its checkpoints and `headrace train --resume RUN_DIR` continues
it on Ray (one command, not automatic).

Secrets: the Redis password reaches the Ray actors as $HEADRACE_REDIS_PASSWORD in their runtime
environment, never in the URL, their arguments or a log.

Weights: the directory store, RUN_DIR/weights, which every node must reach at the same path (one
machine, or a shared filesystem), or the Redis store on the buffer's server (`weights.backend:
redis`), which needs none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from headrace import xla_flags
from headrace.config import Config
from headrace.runtime import build, processes, ray_buffer, worker

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0  # the placement group's reservation and the hosts' first reply
UNAVAILABLE_RETRY_S = 1.0  # how soon an actor Ray is restarting is called again
ACCEPTED_S = 5.0  # a run call in flight this long was accepted by a live actor


class Host:
    """One Ray actor: a learner host or a rollout worker, running its entry point in this worker
    process (Ray owns the process: no `worker._setup`); `stop` ends the run loop gracefully."""

    def __init__(self, name: str):
        import sys

        sys.stdout.flush()
        os.dup2(2, 1)  # the driver's stdout is its own (`--json`); Ray forwards stderr there
        logging.basicConfig(level=logging.WARNING,
                            format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s")
        self.name = name
        self.stop_event = threading.Event()
        xla_flags.use_cpu_memory_scheduler()  # a Ray worker has not run the command line

    def node(self) -> str:
        """The Ray node id this host runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        """This host's process id (a test kills a node's processes by it)."""
        return os.getpid()

    def coordinator(self) -> str:
        """host:port for `jax.distributed` (host 0): this node's address and a free port."""
        import ray

        from headrace.parallel import multihost

        return f"{ray.util.get_node_ip_address()}:{multihost.free_port()}"

    def learner(self, config_data: dict, run_dir: str, url: str, run_id: str, process_id: int,
                processes: int, coordinator: str) -> None:
        self.stop_event.clear()
        with worker._recording(run_dir, self.name):
            worker._learner(config_data, run_dir, url, run_id, process_id, processes,
                            coordinator, self.stop_event, self.name)

    def actor(self, config_data: dict, run_dir: str, url: str, run_id: str, index: int) -> None:
        self.stop_event.clear()
        with worker._recording(run_dir, self.name):
            worker._actor(config_data, run_dir, url, run_id, index, self.stop_event, self.name,
                          False)

    def stop(self) -> None:
        self.stop_event.set()


@dataclasses.dataclass
class Member:
    name: str
    handle: Any
    ref: Any = None  # the run call in flight (None: not running, start at next_start)
    restarts: int = 0  # crashes in a row
    next_start: float = 0.0
    started_at: float = 0.0
    unavailable: bool = False  # its last call found it restarting (one death, counted once)


def _reason(error: BaseException) -> str:
    """A one-line reason from a Ray error (the cause of a task error; the first line of a death)."""
    import ray

    if isinstance(error, ray.exceptions.RayTaskError):
        cause = error.cause
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"


class RaySupervisor:
    """`processes.Supervisor`'s duties over Ray actors: start, watch and restart, stop."""

    def __init__(self, config: Config, run_dir, url: str, run_id: str):
        self.config = config
        self.run_dir = run_dir
        self.url = url
        self.run_id = run_id
        self.data = build.without_secrets(config).to_dict()
        self.failure: str | None = None
        self.restarts = 0
        self.stopping = False
        self.grace_s = processes.GRACE_S  # kept current by `processes.train`
        self._finished = False
        self.group = None
        self.learners: list[Member] = []
        self.actors: list[Member] = []

    def _reserve(self) -> None:
        """Reserves the placement group and creates the hosts in its bundles.

        Raises:
          LaunchError: the cluster cannot hold the bundles (in READY_TIMEOUT_S).
        """
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        config, run_id = self.config, self.run_id
        run, hosts, n = config.run, config.parallel.processes, config.actor.num_actors
        bundles = ([dict(run.ray_learner_bundle) for _ in range(hosts)]
                   + [dict(run.ray_actor_bundle) for _ in range(n)])
        self.group = placement_group(bundles, strategy=run.ray_strategy,
                                     name=f"headrace-{run_id}")
        ready, _ = ray.wait([self.group.ready()], timeout=READY_TIMEOUT_S)
        if not ready:
            raise processes.LaunchError(
                f"Ray could not reserve {hosts} learner bundle(s) {dict(run.ray_learner_bundle)} "
                f"and {n} actor bundle(s) {dict(run.ray_actor_bundle)} ({run.ray_strategy}) in "
                f"{READY_TIMEOUT_S:.0f} s; the cluster has {ray.cluster_resources()}: add nodes "
                "or change run.ray_learner_bundle / run.ray_actor_bundle")
        env = {"env_vars": {build.PASSWORD_ENV: config.buffer.password}} \
            if config.buffer.password else {}
        remote = ray.remote(Host)

        def host(name: str, index: int, bundle: dict, restarts: int) -> Member:
            strategy = PlacementGroupSchedulingStrategy(self.group,
                                                        placement_group_bundle_index=index)
            handle = remote.options(name=f"headrace-{run_id}-{name}", max_concurrency=4,
                                    max_restarts=restarts, scheduling_strategy=strategy,
                                    runtime_env=env, **ray_buffer.resources_of(bundle)).remote(name)
            return Member(name, handle)

        self.learners = [host("learner" if hosts == 1 else f"learner-{i}", i,
                              run.ray_learner_bundle, 0) for i in range(hosts)]
        # Ray restarts a dead actor process without limit; the count in a row is ours (check).
        self.actors = [host(f"actor-{i}", hosts + i, run.ray_actor_bundle, -1)
                       for i in range(n)]

    # --- what processes.train calls --------------------------------------------------------------

    def learner_gone(self) -> str | None:
        import ray

        ref = self.learners[0].ref
        if ref is None or not ray.wait([ref], timeout=0)[0]:
            return None
        try:
            ray.get(ref)
            return f"{self.learners[0].name} returned"
        except Exception as error:  # Ray's errors carry the learner's
            return f"{self.learners[0].name}: {_reason(error)}"

    def finished(self) -> bool:
        return self._finished

    def start_learner(self) -> None:
        import ray

        self._reserve()
        hosts = len(self.learners)
        coordinator = (ray.get(self.learners[0].handle.coordinator.remote(),
                               timeout=READY_TIMEOUT_S) if hosts > 1 else "")
        for i, member in enumerate(self.learners):
            member.ref = member.handle.learner.remote(self.data, str(self.run_dir), self.url,
                                                      self.run_id, i, hosts, coordinator)

    def start_actors(self) -> None:
        for member in self.actors:
            self._start_actor(member)

    def _start_actor(self, member: Member) -> None:
        index = int(member.name.split("-")[1])
        member.started_at = time.monotonic()
        member.ref = member.handle.actor.remote(self.data, str(self.run_dir), self.url,
                                                self.run_id, index)

    def check(self) -> None:
        """Restarts crashed actors (with backoff); records a learner failure or its finish."""
        import ray

        if self.stopping:
            return
        for member in self.learners:
            if member.ref is None or not ray.wait([member.ref], timeout=0)[0]:
                continue
            try:
                ray.get(member.ref)
                if member is self.learners[0]:
                    self._finished = True  # run.max_steps reached
            except Exception as error:
                if self.failure is None:
                    self.failure = f"{member.name}: {_reason(error)}"
            member.ref = None
        now = time.monotonic()
        for member in self.actors:
            if member.ref is None:
                if now >= member.next_start and self.failure is None:
                    self._start_actor(member)
                continue
            if not ray.wait([member.ref], timeout=0)[0]:
                if now - member.started_at >= ACCEPTED_S:
                    member.unavailable = False  # its loop runs: the next death counts again
                continue
            try:
                ray.get(member.ref)
                why = f"{member.name} returned while the run went on"
            except ray.exceptions.ActorUnavailableError as error:
                # Its process or node died and Ray is restarting it: call again shortly, and
                # count the death once however many calls find it restarting.
                member.ref = None
                member.next_start = now + UNAVAILABLE_RETRY_S
                if not member.unavailable:
                    log.warning("%s: %s; Ray restarts it", member.name, _reason(error))
                    member.unavailable = True
                    member.restarts += 1
                    self.restarts += 1
                    if member.restarts > self.config.actor.max_restarts and self.failure is None:
                        self.failure = (f"{member.name}: {_reason(error)} (died {member.restarts} "
                                        f"times in a row; actor.max_restarts="
                                        f"{self.config.actor.max_restarts})")
                continue
            except Exception as error:
                why = f"{member.name}: {_reason(error)}"
            member.ref = None
            member.unavailable = False
            if now - member.started_at >= processes.HEALTHY_S:
                member.restarts = 0
            if member.restarts >= self.config.actor.max_restarts:
                if self.failure is None:
                    self.failure = (f"{why} (crashed {member.restarts + 1} times in a row; "
                                    f"actor.max_restarts={self.config.actor.max_restarts})")
                continue
            backoff = processes.BACKOFF_S[min(member.restarts, len(processes.BACKOFF_S) - 1)]
            log.warning("%s; restarting in %.0f s", why, backoff)
            member.next_start = now + backoff
            member.restarts += 1
            self.restarts += 1

    def stop(self) -> None:
        """Asks every host to stop, waits a grace period, then kills them and frees the group."""
        import ray

        self.stopping = True
        members = [*self.actors, *self.learners]
        for member in members:
            try:
                member.handle.stop.remote()
            except Exception:  # a dead actor: nothing to ask
                pass
        refs = [m.ref for m in members if m.ref is not None]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=self.grace_s)
        for member in members:
            ray.kill(member.handle, no_restart=True)
        if self.group is not None:
            ray.util.remove_placement_group(self.group)
        self.group, self.actors, self.learners = None, [], []  # stopped: a second call is a no-op

    # --- what a cluster test or bench reads ------------------------------------------------------

    def placement(self, names=None, timeout_s: float = 60.0) -> dict[str, str]:
        """Host name -> the Ray node id it runs on, as Ray reports it, for the hosts `names`
        (default all; waits for restarting actors up to `timeout_s`)."""
        import ray

        members = [m for m in (*self.learners, *self.actors) if names is None or m.name in names]
        nodes = ray.get([m.handle.node.remote() for m in members], timeout=timeout_s)
        return {m.name: node for m, node in zip(members, nodes, strict=True)}

    def pids(self, names, timeout_s: float = 60.0) -> list[int]:
        """The process ids of the hosts `names`."""
        import ray

        members = [m for m in (*self.learners, *self.actors) if m.name in names]
        return ray.get([m.handle.pid.remote() for m in members], timeout=timeout_s)


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Sends what is written to file descriptor 1 to 2 meanwhile: Ray prints its workers' and
    nodes' messages on the driver's stdout, which belongs to `--json`."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def connect(config: Config) -> bool:
    """Joins the cluster (`run.ray_address`, else $RAY_ADDRESS, else a new local one) unless this
    process is connected already; returns whether it connected (and so must disconnect).

    Raises:
      ConfigError: Ray is not installed.
    """
    try:
        import ray
    except ImportError:
        from headrace.config import ConfigError

        raise ConfigError("run.launcher=ray: Ray is not installed; pip install 'headrace[ray]'"
                          ) from None
    if ray.is_initialized():
        return False
    # "local" starts a new instance: never a stranger's found in /tmp/ray.
    address = config.run.ray_address or os.environ.get("RAY_ADDRESS") or "local"
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    return True


def train(config: Config, *, live: bool = True, t0: float | None = None,
          resume_dir=None, on_start=None) -> dict[str, Any]:
    """Runs a whole training job on a Ray cluster; returns the summary (as `processes.train`).

    Args:
      on_start: called with the `RaySupervisor` once it exists (a bench watches and faults it).
    """
    def make(*args) -> RaySupervisor:
        supervisor = RaySupervisor(*args)
        if on_start is not None:
            on_start(supervisor)
        return supervisor

    with quiet_stdout():
        connected = connect(config)
        try:
            return processes.train(config, live=live, t0=t0, resume_dir=resume_dir,
                                   make_supervisor=make, start_buffer=ray_buffer.start)
        finally:
            if connected:
                import ray

                ray.shutdown()
