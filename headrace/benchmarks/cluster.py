"""Cluster benchmark: guess_number trains on a local Ray cluster while a worker node is killed.

    headrace bench cluster [--quick] [--steps N] [--kill-at STEP] [--json]

It starts its own cluster (`ray.cluster_utils.Cluster`: a head with the custom resources
`headrace_learner` and `headrace_buffer`, two worker nodes with `headrace_actor`; all on this
machine) and runs `run.launcher: ray` in this process: the learner in a bundle on the head, two
actors in bundles that need `headrace_actor` (so on the worker nodes; SPREAD puts one on each),
the embedded Redis (`buffer.fsync: always`) in a bundle that needs `headrace_buffer` (so on the
head, `run.ray_buffer_bundle`), which also holds the weights (`weights.backend: redis`, as on
nodes that share no filesystem), the evaluation in this driver, a ledger (`run.ledger: true`)
and a checkpoint every 4 steps. At learner step `--kill-at` it reads where Ray placed the hosts,
then kills the worker node that holds actor-0 (`Cluster.remove_node`, not gracefully) and pauses
the other actor (SIGSTOP) until the moved one answers again, so the learner, short of data, waits
for it: Ray moves the dead node's bundle to the surviving worker node and restarts the actor
there, the supervisor starts its loop again, and the run trains on to its step limit. After the
run the accounting identity is checked exactly, by group id, from the ledger, with
`headrace.runtime.accounting` (the code `headrace bench chaos` uses), on the run's Redis
restarted from its append-only file.

Output (`--json`: one object on stdout): `nodes` (Ray's node count at the start), `actors_per_node`
(node id -> actors, from Ray, before and after the kill), `buffer_node` (where Ray placed the
buffer's host), `node_killed`, `actor_restarts`, `steps`,
`success_rate` (the final greedy evaluation), `written`, `trained`, `dropped` (by reason),
`in_buffer`, `lost`, `trained_twice`, `quarantined`, `identity_exact`, `wall_s`. Exit status 1
when a promise broke: an actor not on a worker node, the buffer not on the head, no restart onto
the surviving node, fewer
steps than asked, anything lost or trained twice, the identity not exact, or (not with --quick)
greedy success below a random guesser + 0.3.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import threading
import time

from headrace import benchlib
from headrace.benchlib import bench_parser
from headrace.metrics.records import last_record
from headrace.runtime import ray_buffer
from headrace.runtime.ray_launcher import quiet_stdout

WATCH_TIMEOUT_S = 600.0
# Learner steps by default: at 120 the final greedy success was 0.875 twice on an idle machine
# but 0.625 once at load average 16; 160 leaves margin.
STEPS = 160
# The GCS declares a node dead after this many missed health checks (Ray's defaults take ~30 s;
# a short run would end before its actors restarted). A killed node refuses the checks at once:
# ~5 s (30 s at most, each check waiting its timeout). A live node starved of CPU on a loaded
# machine must miss five checks of 5 s each in a row, not three of 1 s, to be declared dead.
# (The node killer waits up to WATCH_TIMEOUT_S for the moved actors: that covers it.)
HEALTH_CHECKS = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
                 "health_check_timeout_ms": 5000, "health_check_failure_threshold": 5}


def settings(run_dir: pathlib.Path, steps: int) -> list[str]:
    """`--set` overrides of examples/guess_number.yaml for the cluster run."""
    values = {
        "run.dir": str(run_dir), "run.launcher": "ray", "buffer.fsync": "always",
        "weights.backend": "redis",  # as on nodes that share no filesystem
        "run.ledger": "true", "run.checkpoint_every": 4, "run.max_wall_s": 0,
        "run.max_steps": steps, "run.stop_at_target": "false", "run.eval_every": 0,
        "run.log_every": 1, "env.kwargs.n": 8, "env.kwargs.max_turns": 3,
        "learner.minibatches": 1, "learner.optimizer.lr": "3e-3", "learner.groups_per_batch": 8,
        "actor.num_actors": 2, "actor.envs_per_actor": 32, "actor.max_batch": 64,
        "buffer.capacity": 16, "actor.max_restarts": 1000,
        "run.ray_learner_bundle": "{CPU: 1, headrace_learner: 1}",
        "run.ray_actor_bundle": "{CPU: 1, headrace_actor: 1}", "run.ray_strategy": "SPREAD",
        "run.ray_buffer_bundle": "{CPU: 1, headrace_buffer: 1}",
    }
    return [f"{key}={value}" for key, value in values.items()]


def learner_step(run_dir: pathlib.Path) -> int:
    """The learner's step in the last metrics record (0 before the first)."""
    return int((last_record(run_dir) or {}).get("learner/step", 0))


def per_node(placement: dict[str, str]) -> dict[str, int]:
    return dict(collections.Counter(node for name, node in placement.items()
                                    if name.startswith("actor-")))


class Killer:
    """On its own thread: at learner step `kill_at`, records the actors' placement and kills the
    worker node of actor-0, then records the placement once every actor answers again."""

    def __init__(self, cluster, workers, run_dir: pathlib.Path, kill_at: int):
        self.cluster, self.workers, self.run_dir, self.kill_at = cluster, workers, run_dir, kill_at
        self.supervisor = None
        self.before: dict[str, str] = {}
        self.after: dict[str, str] = {}
        self.killed: str | None = None
        self.buffer_node: str | None = None  # where Ray placed the buffer's host
        self.host_pids: set[int] = set()  # every host process seen (checked gone at the end)
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="node-killer", daemon=True)

    def attach(self, supervisor) -> None:
        self.supervisor = supervisor
        self.thread.start()

    def _run(self) -> None:
        import ray

        paused: list[int] = []
        try:
            deadline = time.monotonic() + WATCH_TIMEOUT_S
            while learner_step(self.run_dir) < self.kill_at:
                if time.monotonic() > deadline or self.supervisor.stopping:
                    raise TimeoutError(f"the learner did not reach step {self.kill_at}")
                time.sleep(0.2)
            self.before = self.supervisor.placement()
            buffer = ray.get_actor(ray_buffer.host_name(self.run_dir))
            self.buffer_node = ray.get(buffer.node.remote(), timeout=WATCH_TIMEOUT_S)
            node = self.before["actor-0"]
            victim = next(w for w in self.workers if w.node_id == node)
            moved = [n for n, at in self.before.items() if at == node]
            # A machine that dies takes its processes with it: Cluster.remove_node stops the
            # node's raylet and stores, and the hosts' worker processes are killed here.
            self.host_pids.update(self.supervisor.pids(list(self.before)))
            pids = self.supervisor.pids(moved)
            # The actors elsewhere are paused until the moved ones answer again: the learner,
            # short of data, then waits for the restarted actors, however long Ray takes to
            # restart them (else a fast learner can reach its step limit first).
            paused = self.supervisor.pids([n for n, at in self.before.items()
                                           if at != node and n.startswith("actor-")])
            _signal(paused, signal.SIGSTOP)
            self.cluster.remove_node(victim, allow_graceful=False)
            _signal(pids, signal.SIGKILL)
            self.killed = node
            while True:  # until every moved host answers from a live node
                try:
                    where = self.supervisor.placement(moved, timeout_s=WATCH_TIMEOUT_S)
                except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
                    where = {"restarting": node}  # Ray is restarting one: ask again
                if where and node not in where.values() and not self.supervisor.stopping:
                    break
                if time.monotonic() > deadline or self.supervisor.stopping:
                    raise TimeoutError(f"the run ended or timed out before every actor "
                                       f"answered from a live node: {where}")
                time.sleep(0.5)
            _signal(paused, signal.SIGCONT)
            paused = []
            self.after = self.supervisor.placement(timeout_s=WATCH_TIMEOUT_S)
            self.host_pids.update(self.supervisor.pids(list(self.after)))
        except BaseException as error:  # reported by the bench
            self.error = error
        finally:
            _signal(paused, signal.SIGCONT)
            self.done.set()


def left_behind(pids: set[int], timeout_s: float = 30.0) -> list[int]:
    """The processes of `pids` still running after `timeout_s` (zombies count as gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid in sorted(pids):
            try:
                state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def _descendants(pids: set[int]) -> set[int]:
    """Every process started, directly or not, by one of `pids` (read now)."""
    import psutil

    found: set[int] = set()
    for pid in pids:
        try:
            found.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            continue
    return found


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            continue


def scenario(work: pathlib.Path, steps: int, kill_at: int) -> tuple[dict, list[str]]:
    """Runs the scenario in `work`; returns the report and the promises broken."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    from headrace.config import load
    from headrace.runtime import ray_launcher

    run_dir = work / "run"
    config = load(benchlib.EXAMPLES / "guess_number.yaml", settings(run_dir, steps))
    started = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"headrace_learner": 1, "headrace_buffer": 1},
        "include_dashboard": False,
        "_system_config": HEALTH_CHECKS})
    ray_pids: set[int] = set()
    descendants: set[int] = set()
    try:
        workers = [cluster.add_node(num_cpus=2, resources={"headrace_actor": 2})
                   for _ in range(2)]
        ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING")
        cluster.wait_for_nodes()
        ray_pids = {info.process.pid for node in [cluster.head_node, *workers]
                    for infos in node.all_processes.values() for info in infos}
        descendants = _descendants(ray_pids)  # the raylets' agents (not in all_processes)
        nodes = len([n for n in ray.nodes() if n["Alive"]])
        head = cluster.head_node.node_id
        killer = Killer(cluster, workers, run_dir, kill_at)
        summary = ray_launcher.train(config, live=False, on_start=killer.attach)
        restarts = killer.supervisor.restarts
    finally:
        ray.shutdown()
        cluster.shutdown()
        # A raylet's dashboard and runtime-env agents can outlive the cluster's shutdown (seen
        # here after a node kill): ended here, so the bench leaves no process behind.
        _signal(left_behind(descendants - ray_pids, timeout_s=10.0), signal.SIGKILL)
    from headrace.runtime.accounting import stopped_run_identity

    counts = stopped_run_identity(run_dir)
    problems = []
    left = left_behind(ray_pids | killer.host_pids)
    if left:
        problems.append(f"Ray processes left running after the cluster's shutdown: {left}")
    if killer.error is not None:
        problems.append(f"the node kill failed: {type(killer.error).__name__}: {killer.error}")
    elif not killer.done.is_set():
        problems.append(f"the run ended before the actors answered again: {killer.after}")
    worker_ids = {w.node_id for w in workers}
    before, after = per_node(killer.before), per_node(killer.after)
    if killer.before and not set(before) <= worker_ids:
        problems.append(f"actors were placed off the worker nodes: {killer.before}")
    if killer.before.get("learner") not in (None, head):
        problems.append(f"the learner is not on the head node: {killer.before}")
    if killer.before and killer.buffer_node != head:
        problems.append(f"the buffer's host is not on the head node: {killer.buffer_node}")
    survivor = worker_ids - {killer.killed}
    if killer.done.is_set() and (not set(after) <= survivor or sum(after.values()) != 2):
        problems.append(f"after the kill, actors are not all on the surviving node: {after}")
    if restarts < 1:
        problems.append("no actor restart was counted")
    if summary["steps"] != steps or summary["errors"]:
        problems.append(f"the run stopped at step {summary['steps']} of {steps} "
                        f"({summary['stopped_by']}): {summary['errors']}")
    if counts["lost"] or counts["trained_twice"] or not counts["identity_exact"]:
        problems.append(f"the accounting identity broke: {counts}")
    report = {
        "nodes": nodes, "actors_per_node": {"before": before, "after": after},
        "buffer_node": killer.buffer_node, "node_killed": killer.killed,
        "actor_restarts": restarts, "steps": summary["steps"],
        "success_rate": summary["final_success_rate"], "written": counts["written"],
        "trained": counts["trained"], "dropped": counts["dropped"],
        "in_buffer": counts["in_buffer"], "lost": counts["lost"],
        "trained_twice": counts["trained_twice"], "quarantined": counts["quarantined"],
        "identity_exact": counts["identity_exact"],
        "wall_s": round(time.monotonic() - started, 1),
    }
    return report, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headrace bench cluster", parents=[bench_parser()],
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=0, help=f"learner steps (default {STEPS}, "
                        "--quick 24)")
    parser.add_argument("--kill-at", type=int, default=0, help="learner step of the node kill "
                        "(default: a third of the steps)")
    args = parser.parse_args(argv)
    steps = args.steps or (24 if args.quick else STEPS)
    kill_at = args.kill_at or (4 if args.quick else steps // 3)
    work = pathlib.Path(tempfile.mkdtemp(prefix="headrace-cluster-"))
    try:
        with quiet_stdout():  # Ray prints its nodes' deaths on stdout: `--json` owns it
            report, problems = scenario(work, steps, kill_at)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not args.quick and (report["success_rate"] or 0.0) < benchlib.LEARNED_SUCCESS_N8:
        problems.append(f"the run did not learn: greedy success {report['success_rate'] or 0.0:.3f} "
                        f"< {benchlib.LEARNED_SUCCESS_N8:.3f} (5 of the 8 secrets)")
    return benchlib.finish(report, problems, as_json=args.json, title="headrace bench cluster")


if __name__ == "__main__":
    sys.exit(main())
