"""Chaos benchmark: a real run that keeps its promises while processes are SIGKILLed under it.

    headrace bench chaos [--faults 24] [--seed 0] [--steps-per-fault 12] [--quick] [--json]

One `headrace train` of guess_number through the command line, the processes launcher with the
embedded Redis (`buffer.fsync: always`), a ledger (`run.ledger: true`) and a checkpoint every 4
steps. At seeded random moments (a random learner step in each fault's window, then a random
fraction of a second) it SIGKILLs one of:

  - `learner`: the learner process. The supervisor ends the run with an error; `--resume` goes on
    from the last checkpoint (entries trained after it come back and are trained again).
  - `actor`: an actor process. The supervisor restarts it (backoff 1 s); the run goes on.
  - `redis`: the redis-server. The supervisor restarts it on the same port from its append-only
    file; the children's clients retry their connections; the run goes on.
  - `tree`: the supervisor's whole process group (supervisor, learner, actors; the server dies
    with its parent), then `--resume`.

After each fault, once the run is down (learner, tree) or has trained two more steps (actor,
redis), the accounting identity (docs/design.md) is checked exactly, by group id, from the ledger
(`headrace.runtime.accounting`): written = trained + dropped (by reason) + quarantined + in the
buffer, nothing lost, nothing trained twice. A live run is paused for the check (SIGSTOP to its
process group, SIGCONT after), so no put, acknowledgement or checkpoint lands between two reads.
The run has no `run.max_steps`: a fast learner can pass a fault's step by many steps before the
fault lands (the step is read from the metrics, written every half second), and a run that ended
by itself would leave the later faults nothing to hit. After the last fault the run trains
`--final-steps` more steps and is stopped as a user stops one, with Ctrl-C (SIGINT to the
`headrace train` process): it must exit 0, `stopped_by: interrupted`, with no errors; its final
greedy evaluation must find 5 of the 8 secrets (`benchlib.LEARNED_SUCCESS_N8`; long mode:
`--quick` runs too few steps to learn).

Output (`--json`: one object on stdout; a table on stderr, one line per fault before it):
`faults` (by kind), `steps` (the last run's), `written`, `trained`, `dropped` (by reason),
`quarantined`, `in_buffer` (the final check's), `lost` and `trained_twice` (the most any check
found: both must be 0), `identity_exact` (every check), `final_success_rate`. Exit status 1 when
a promise was broken, a fault could not be injected or the run did not recover from one.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from headrace import benchlib
from headrace.benchlib import bench_parser, emit
from headrace.metrics.records import last_record
from headrace.runtime.worker import STACKS_SIGNAL

KINDS = ("learner", "actor", "redis", "tree")
CHECKPOINT_EVERY = 4
STOP_S = 300.0  # from the last Ctrl-C to the run's exit: its final evaluation included


def settings(quick: bool) -> list[str]:
    """`--set` overrides of examples/guess_number.yaml for a chaos run (stopped by the bench)."""
    values = {
        "run.launcher": "processes", "buffer.fsync": "always", "run.ledger": "true",
        "run.checkpoint_every": CHECKPOINT_EVERY, "run.max_wall_s": 0, "run.max_steps": 0,
        "run.stop_at_target": "false", "run.eval_every": 0, "run.log_every": 1,
        "env.kwargs.n": 8, "env.kwargs.max_turns": 3, "learner.minibatches": 1,
        "learner.optimizer.lr": "3e-3", "learner.groups_per_batch": 8 if quick else 16,
        "actor.envs_per_actor": 64 if quick else 128, "actor.max_batch": 128,
        "buffer.capacity": 16, "actor.max_restarts": 1000,
    }
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


# --- the process tree -----------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a live process, None when gone."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[2])


def members(pgid: int) -> dict[int, str]:
    """pid -> name (/proc/PID/comm) of the live processes of process group `pgid`."""
    found = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] == pgid and stat[0] != "Z":
                try:
                    found[int(entry.name)] = (entry / "comm").read_text().strip()
                except OSError:
                    continue
    return found


def dump_stacks(pgid: int) -> None:
    """Every headrace process of group `pgid` prints its threads' stacks to its stderr (`kill
    -USR1`, `headrace.runtime.worker.stacks_on_signal`; not a redis-server, for which the signal
    means something else). Returns once faulthandler has had time to write."""
    for pid, name in members(pgid).items():
        if name.startswith("redis"):
            continue
        try:
            os.kill(pid, STACKS_SIGNAL)
        except ProcessLookupError:
            pass
    time.sleep(3.0)  # faulthandler writes from the signal handler, at once


def redis_pids(run_dir: pathlib.Path) -> set[int]:
    """The live redis-server serving RUN_DIR/redis, from its pid file (the server rewrites its
    command line, so the config path cannot be matched there)."""
    try:
        pid = int((run_dir / "redis" / "redis.pid").read_text().strip())
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        port = _redis_port(run_dir)
    except (OSError, ValueError, StopIteration):
        return set()
    stat = _stat(pid)
    ours = b"redis-server" in cmdline and f":{port}\0".encode() in cmdline  # not a reused pid
    return {pid} if ours and stat is not None and stat[0] != "Z" else set()


def wait_gone(pids, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while any((stat := _stat(pid)) is not None and stat[0] != "Z" for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class Run:
    """One `headrace train` process tree (a fresh run or a `--resume`)."""

    def __init__(self, run_dir: pathlib.Path, log, args: list[str]):
        self.run_dir = run_dir
        self.started = time.time()
        self.out = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "headrace.cli", "train", *args, "--json", "--no-live"],
            env=benchlib.child_env(), stdout=self.out, stderr=log, start_new_session=True)

    @property
    def pgid(self) -> int:
        return self.process.pid  # a session leader: its pid is its group

    def child(self, name: str) -> int | None:
        return next((pid for pid, comm in members(self.pgid).items() if comm == name), None)

    def step(self) -> int:
        """The learner's step in the newest metrics record if this run wrote it, else 0 (after a
        resume the file ends with the crashed run's records: its last steps were undone)."""
        record = last_record(self.run_dir) or {}
        return int(record.get("learner/step", 0)) if record.get("time", 0) >= self.started else 0

    def summary(self) -> dict | None:
        self.out.seek(0)
        text = self.out.read().strip()
        return json.loads(text) if text else None

    def kill_tree(self) -> None:
        tree = set(members(self.pgid)) | redis_pids(self.run_dir)
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(30)
        if not wait_gone(tree, 30):
            raise RuntimeError(f"processes outlived the SIGKILL of their tree: {tree}")

    def cleanup(self) -> None:
        if self.process.poll() is None:
            self.kill_tree()
        for pid in redis_pids(self.run_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def learner_step(run_dir: pathlib.Path) -> int:
    """The learner's step in the last metrics record, of whichever run (0 before the first)."""
    return int((last_record(run_dir) or {}).get("learner/step", 0))


# --- the checks -----------------------------------------------------------------------------------


def _redis_port(run_dir: pathlib.Path) -> int:
    return next(int(line.split()[1]) for line in
                (run_dir / "redis" / "redis.conf").read_text().splitlines()
                if line.startswith("port "))


def check(run_dir: pathlib.Path, live: Run | None) -> dict:
    """The identity, by id: on the live server with the run paused (`live`), or on the run's
    server restarted from its append-only file (the run is down)."""
    import redis

    from headrace.buffer.server import SECRETS_FILE
    from headrace.runtime.accounting import accounting, identity, stopped_run_identity

    if live is not None:
        # The live server takes its default user's password (the run's secrets file, 0600).
        admin = json.loads((run_dir / SECRETS_FILE).read_text())["admin"]
        os.killpg(live.pgid, signal.SIGSTOP)
        try:
            time.sleep(0.1)  # a signal reaches every member before the first read
            client = redis.Redis(port=_redis_port(run_dir), password=admin, socket_timeout=30)
            try:
                return identity(accounting(run_dir, client))
            finally:
                client.close()
        finally:
            os.killpg(live.pgid, signal.SIGCONT)
    return stopped_run_identity(run_dir)


# --- the run --------------------------------------------------------------------------------------


class Chaos:
    def __init__(self, args: argparse.Namespace, work: pathlib.Path):
        self.args = args
        self.run_dir = work / "run"
        self.log = open(work / "train.log", "w")
        self.rng = random.Random(args.seed)
        self.faults = {kind: 0 for kind in KINDS}
        self.checks: list[dict] = []
        self.problems: list[str] = []
        per_kind = -(-args.faults // len(KINDS))
        self.plan = [kind for kind in KINDS for _ in range(per_kind)][:args.faults]
        self.rng.shuffle(self.plan)
        spf = args.steps_per_fault
        self.warmup = CHECKPOINT_EVERY + 2  # a checkpoint exists before the first fault
        self.at = [self.warmup + i * spf + self.rng.randint(0, spf // 2)
                   for i in range(len(self.plan))]
        self.started = time.monotonic()

    def note(self, text: str) -> None:
        print(f"chaos {time.monotonic() - self.started:6.1f} s: {text}", file=sys.stderr,
              flush=True)

    def wait(self, run: Run, what: str, until, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not until():
            if run.process.poll() is not None:
                raise RuntimeError(f"the run exited with code {run.process.returncode} while "
                                   f"waiting for {what}; see {self.log.name}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {timeout_s:.0f} s; see {self.log.name}")
            time.sleep(0.05)

    def record(self, kind: str, result: dict, step: int) -> None:
        self.checks.append(result)
        self.note(f"{kind:>7} at step {step:>4}: written {result['written']}, trained "
                  f"{result['trained']}, dropped {sum(result['dropped'].values())}, in buffer "
                  f"{result['in_buffer']}, lost {result['lost']}, trained twice "
                  f"{result['trained_twice']}, exact {result['identity_exact']}")
        if not result["identity_exact"]:
            self.problems.append(f"after the {kind} fault at step {step}: {result}")

    def resume(self) -> Run:
        if not wait_gone(redis_pids(self.run_dir), 30):
            raise RuntimeError("the run's redis-server outlived its supervisor")
        return Run(self.run_dir, self.log, ["--resume", str(self.run_dir)])

    def inject(self, run: Run, kind: str) -> tuple[Run, int]:
        """One fault; returns the run that goes on (the same one, or a resumed one) and the
        learner's step when the fault came."""
        time.sleep(self.rng.uniform(0.0, 0.5))
        killed = None
        if kind in ("learner", "actor"):
            name = "learner" if kind == "learner" else "actor-0"
            found: dict[str, int | None] = {}

            def present() -> bool:  # an actor restarted after the last fault may be in backoff
                found["pid"] = run.child(name)
                return found["pid"] is not None

            self.wait(run, f"a {name} process", present, 120)
            killed = found["pid"]
            step = learner_step(self.run_dir)
            os.kill(killed, signal.SIGKILL)
        elif kind == "redis":
            self.wait(run, "a redis-server", lambda: len(redis_pids(self.run_dir)) == 1, 60)
            step = learner_step(self.run_dir)
            killed = redis_pids(self.run_dir).pop()
            os.kill(killed, signal.SIGKILL)
        else:
            step = learner_step(self.run_dir)
            run.kill_tree()
        self.faults[kind] += 1
        if kind == "learner":  # the supervisor ends the run, with the learner's death in it
            run.process.wait(120)
            summary = run.summary() or {}
            if run.process.returncode != 1 or "learner" not in " ".join(summary.get("errors", [])):
                self.problems.append(f"the learner's death was not reported: exit "
                                     f"{run.process.returncode}, {summary.get('errors')}")
        if kind in ("learner", "tree"):
            self.record(kind, check(self.run_dir, None), step)
            return self.resume(), step
        target = step + 2  # the run goes on: it trains two more steps (with a new actor)

        def recovered() -> bool:
            # `step` may be a record behind the learner, so the steps alone can look trained
            # before a killed server is back: the check below pauses the whole run, supervisor
            # included, and would find no server and leave none restarted.
            actor, servers = run.child("actor-0"), redis_pids(self.run_dir)
            return (run.step() >= target and actor not in (None, killed)
                    and len(servers) == 1 and killed not in servers)

        self.wait(run, f"training after the {kind} fault", recovered, 180)
        self.record(kind, check(self.run_dir, run), step)
        return run, step

    def run(self) -> dict:
        run = Run(self.run_dir, self.log, ["examples/guess_number.yaml",
                                           "--set", f"run.dir={self.run_dir}",
                                           *settings(self.args.quick)])
        try:
            step = 0
            for kind, at in zip(self.plan, self.at):
                self.wait(run, f"learner step {at}",
                          lambda at=at, run=run: run.step() >= at, 300)
                run, step = self.inject(run, kind)
            end = step + self.args.final_steps
            # A resumed run starts processes, imports JAX and loads compiled programs first:
            # on a loaded machine that alone has taken over a minute.
            self.wait(run, f"learner step {end}", lambda: run.step() >= end,
                      max(300.0, 10.0 * self.args.final_steps))
            run.process.send_signal(signal.SIGINT)  # Ctrl-C: the run stops and evaluates
            try:
                run.process.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                dump_stacks(run.pgid)
                raise RuntimeError(f"the run did not exit within {STOP_S:.0f} s of Ctrl-C; "
                                   f"every process's stacks are at the end of {self.log.name}") from None
            summary = run.summary() or {}
            if (run.process.returncode != 0 or summary.get("stopped_by") != "interrupted"
                    or summary.get("errors") or summary.get("steps", 0) < end):
                self.problems.append(f"the last run ended with code {run.process.returncode}: "
                                     f"{summary}")
        finally:
            run.cleanup()
        final = check(self.run_dir, None)
        self.record("end", final, summary.get("steps", 0))
        success = summary.get("final_success_rate") or 0.0  # None: the run failed
        if not self.args.quick and success < benchlib.LEARNED_SUCCESS_N8:
            self.problems.append(f"the run did not learn: greedy success {success:.3f} < "
                                 f"{benchlib.LEARNED_SUCCESS_N8:.3f} (5 of the 8 secrets)")
        if sum(self.faults.values()) < self.args.faults:
            self.problems.append(f"only {sum(self.faults.values())} faults were injected")
        self.note(f"{sum(self.faults.values())} faults, {len(self.checks)} checks, "
                  f"{time.monotonic() - self.started:.0f} s")
        for problem in self.problems:
            self.note(f"PROBLEM: {problem}")
        return {
            "faults": dict(self.faults), "steps": summary.get("steps", 0),
            "written": final["written"], "trained": final["trained"],
            "dropped": final["dropped"], "quarantined": final["quarantined"],
            "in_buffer": final["in_buffer"],
            "lost": max(c["lost"] for c in self.checks),
            "trained_twice": max(c["trained_twice"] for c in self.checks),
            "identity_exact": all(c["identity_exact"] for c in self.checks),
            "final_success_rate": success,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headrace bench chaos", parents=[bench_parser()],
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=None,
                        help="faults to inject, spread over the four kinds (default 24; quick 4)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the faults' kinds and moments")
    parser.add_argument("--steps-per-fault", type=int, default=None,
                        help="learner steps between faults (default 12; quick 6)")
    parser.add_argument("--final-steps", type=int, default=None,
                        help="steps trained after the last fault (default 120; quick 4)")
    parser.add_argument("--keep", metavar="DIR", default="",
                        help="keep the run folder and log in DIR (default: a temporary folder)")
    args = parser.parse_args(argv)
    args.faults = args.faults if args.faults is not None else (4 if args.quick else 24)
    args.steps_per_fault = args.steps_per_fault or (6 if args.quick else 12)
    args.final_steps = args.final_steps if args.final_steps is not None else \
        (4 if args.quick else 120)
    if args.faults < 1 or args.steps_per_fault < 2:
        parser.error("--faults must be >= 1 and --steps-per-fault >= 2")
    work = pathlib.Path(args.keep) if args.keep else pathlib.Path(tempfile.mkdtemp(
        prefix="headrace-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    chaos = Chaos(args, work)
    result = None
    try:
        result = chaos.run()
    except RuntimeError as error:
        chaos.note(f"FAILED: {error} (the run folder and log are kept in {work})")
        return 1
    finally:
        chaos.log.close()
        if result is not None and not args.keep and not chaos.problems:
            shutil.rmtree(work, ignore_errors=True)
    emit(result, as_json=args.json, title="headrace bench chaos")
    return 1 if chaos.problems else 0


if __name__ == "__main__":
    sys.exit(main())
