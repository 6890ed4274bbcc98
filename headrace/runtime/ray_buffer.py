"""The embedded redis-server on a node of the Ray cluster's choosing (`run.ray_buffer_bundle`).

Without the key the Ray launcher starts the run's Redis in the driver, as the processes launcher
does. With it, a placement group of that one bundle (`headrace-RUN-buffer`) reserves a node, and a
Ray actor there (`BufferHost`) runs `build.start_embedded_redis` in its own process: the server's
files are RUN_DIR/redis on that node, it binds `buffer.host` (a wildcard address is announced
as the node's IP), and the driver, the learner hosts and the actors reach it by URL with the
client password (which comes back to the driver as the result of the start call and reaches the
hosts through their runtime environment, as for a driver-side server).

`RemoteServer` is the driver's handle: the `url`, `dir`, `running`, `start` and `stop` that
`processes.train` uses of a local `RedisServer`, so a crashed redis-server is restarted from its
append-only file on its node as the local one is. The buffer host is not restarted by Ray: a
lost buffer node ends the run with that reason, and `headrace train --resume RUN_DIR` continues it
once a node with the bundle's resources holds RUN_DIR/redis again (a custom resource only that
node has pins it there).
"""

from __future__ import annotations

import logging
import os
import pathlib
import sys
from typing import Any

from headrace import config as config_lib
from headrace.config import Config, load
from headrace.runtime import build, processes, standalone

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0  # the bundle's reservation and the server's start


def host_name(run_dir: pathlib.Path) -> str:
    """The buffer host's Ray actor (and placement group) name."""
    return f"headrace-{run_dir.name}-buffer"


def resources_of(bundle: dict[str, float]) -> dict[str, Any]:
    """Ray actor options that take a whole bundle."""
    rest = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    return {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0),
            "resources": rest}


class BufferHost:
    """One Ray actor holding the run's redis-server on its node."""

    def __init__(self):
        sys.stdout.flush()
        os.dup2(2, 1)  # the driver's stdout is its own (`--json`)
        self.server = None

    def start(self, config_data: dict, run_dir: str, resume: bool) -> tuple[str, str, str]:
        """Starts (or, resuming, restarts from its files) the run's server: (url, the client
        password, the node id)."""
        import ray

        server, config = build.start_embedded_redis(load(data=config_data),
                                                    pathlib.Path(run_dir), resume=resume)
        self.server = server
        url = standalone.connect_url(server.url, config.buffer.host,
                                     address=ray.util.get_node_ip_address())
        return url, config.buffer.password, self.node()

    def running(self) -> bool:
        return self.server is not None and self.server.running

    def restart(self) -> None:
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def node(self) -> str:
        """The Ray node id this host runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()


class RemoteServer:
    """The driver's handle on the buffer host's server (what `processes.train` uses)."""

    def __init__(self, handle: Any, group: Any, url: str, run_dir: pathlib.Path, node: str):
        self.handle, self.group, self.url, self.node = handle, group, url, node
        self.dir = run_dir / "redis"  # on the buffer's node

    @property
    def running(self) -> bool:
        """Whether the server runs (False: restart it with `start`).

        Raises:
          LaunchError: the buffer host itself is gone (its node died).
        """
        import ray

        try:
            return ray.get(self.handle.running.remote(), timeout=READY_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as error:
            raise processes.LaunchError(
                f"the buffer's node {self.node} is lost ({type(error).__name__}); once a node "
                "with run.ray_buffer_bundle's resources holds RUN_DIR/redis, continue with "
                "`headrace train --resume RUN_DIR`") from None

    def start(self) -> RemoteServer:
        import ray

        ray.get(self.handle.restart.remote(), timeout=READY_TIMEOUT_S)
        return self

    def stop(self) -> None:
        import ray

        if self.handle is None:
            return
        try:
            ray.get(self.handle.stop.remote(), timeout=60)
        except Exception as error:  # a dead host took its server with it
            log.warning("stopping the buffer host: %s", error)
        ray.kill(self.handle, no_restart=True)
        ray.util.remove_placement_group(self.group)
        self.handle = None


def start(config: Config, run_dir: pathlib.Path, *, resume: bool = False):
    """`build.start_embedded_redis` for the Ray launcher: on the driver without
    `run.ray_buffer_bundle` (or with `buffer.url`), else on a node the bundle reserves.

    Raises:
      LaunchError: the cluster cannot hold the bundle (in READY_TIMEOUT_S).
    """
    bundle = dict(config.run.ray_buffer_bundle)
    if not bundle or config.buffer.backend != "redis" or config.buffer.url or config.buffer.urls:
        return build.start_embedded_redis(config, run_dir, resume=resume)
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    name = host_name(run_dir)
    group = placement_group([bundle], name=name)
    ready, _ = ray.wait([group.ready()], timeout=READY_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        raise processes.LaunchError(
            f"Ray could not reserve the buffer's bundle {bundle} in {READY_TIMEOUT_S:.0f} s; the "
            f"cluster has {ray.cluster_resources()}: add a node or change "
            "run.ray_buffer_bundle")
    password = build.buffer_password(config)
    env = {"env_vars": {build.PASSWORD_ENV: password}} if password else {}
    handle = ray.remote(BufferHost).options(
        name=name, max_restarts=0, runtime_env=env,
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
        **resources_of(bundle)).remote()
    try:
        url, client_password, node = ray.get(
            handle.start.remote(build.without_secrets(config).to_dict(), str(run_dir), resume),
            timeout=READY_TIMEOUT_S)
    except BaseException:
        ray.kill(handle, no_restart=True)
        ray.util.remove_placement_group(group)
        raise
    log.info("the buffer's redis-server runs on node %s", node)
    server = RemoteServer(handle, group, url, run_dir, node)
    return server, config_lib.replace(config, buffer={"password": client_password},
                                      weights=build.weights_server(config, url))
