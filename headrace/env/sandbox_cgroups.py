"""The sandbox's per-run resources on the host: its uid lease and its cgroups.

Each run gets a cgroup per controller it can use, `pids` (process count, `pids.max`) and `memory`
(the whole run's memory, page cache and its tmpfs included, with no swap: cgroup v2 `memory.max` +
`memory.swap.max`, or v1 `memory.limit_in_bytes` + `memory.memsw.limit_in_bytes`), on cgroup v2
where the controller is enabled there, else on its v1 hierarchy. The memory cgroup nests under the
host process's own memory cgroup where that is writable, so a container's limit still applies
above it. A controller with no writable cgroup is left to rlimits (RLIMIT_NPROC, RLIMIT_AS), which
`probe` reports.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import random
import signal
import time
import uuid

BASE_NAME = "headrace-sandbox"


class CgroupError(RuntimeError):
    """A cgroup of a run could not be made or removed; the message says which and why."""


def _cgroup_mounts() -> list[tuple[str, str, str]]:
    with open("/proc/self/mounts") as f:
        rows = [line.split() for line in f]
    return [(row[1], row[2], row[3]) for row in rows
            if len(row) >= 4 and row[2].startswith("cgroup")]


def _own_path(controller: str | None) -> str:
    """This process's cgroup path in the v1 hierarchy of `controller` (None: the v2 one)."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                names = controllers.split(",") if controllers else []
                if (controller is None and not names) or controller in names:
                    return path
    except (OSError, ValueError):
        pass
    return "/"


def _trial(kind: str, base: str, controller: str) -> None:
    """Makes and removes a run-like cgroup under `base`, setting the controller's limit."""
    os.makedirs(base, exist_ok=True)
    if kind == "cgroup2":
        with open(os.path.join(base, "cgroup.subtree_control"), "w") as f:
            f.write(f"+{controller}")
    trial = os.path.join(base, f"probe-{uuid.uuid4().hex[:8]}")
    os.mkdir(trial)
    try:
        name, value = {"pids": ("pids.max", 8), "memory": (
            "memory.max" if kind == "cgroup2" else "memory.limit_in_bytes", 64 << 20)}[controller]
        with open(os.path.join(trial, name), "w") as f:
            f.write(str(value))
    finally:
        os.rmdir(trial)


def find_base(controller: str) -> tuple[str, str] | None:
    """("cgroup2" | "cgroup1", directory) under which runs get a `controller` cgroup, or None."""
    for mount, fstype, options in _cgroup_mounts():
        if fstype == "cgroup2":
            try:
                with open(os.path.join(mount, "cgroup.controllers")) as f:
                    if controller not in f.read().split():
                        continue
                with open(os.path.join(mount, "cgroup.subtree_control"), "w") as f:
                    f.write(f"+{controller}")
            except OSError:
                continue
            kind, own = "cgroup2", _own_path(None)
        elif controller in options.split(","):
            kind, own = "cgroup1", _own_path(controller)
        else:
            continue
        # memory: under our own cgroup first (a container's limit then holds above the run's)
        parents = [os.path.join(mount, own.lstrip("/")), mount] if controller == "memory" \
            and kind == "cgroup1" else [mount]
        for parent in parents:
            base = os.path.join(parent, BASE_NAME)
            try:
                _trial(kind, base, controller)
                return kind, base
            except OSError:
                continue
    return None


@dataclasses.dataclass
class RunCgroups:
    """The cgroups of one run (one per hierarchy), made by `create`, removed by `sweep`."""

    pids: str | None = None  # the directory holding pids.max
    memory: str | None = None  # the directory holding the memory limit
    memory_kind: str = ""

    @property
    def dirs(self) -> list[str]:
        """Distinct directories the run's processes join (one on v2, one per v1 hierarchy)."""
        return list(dict.fromkeys(d for d in (self.pids, self.memory) if d))

    @classmethod
    def create(cls, pids_base: tuple[str, str] | None, memory_base: tuple[str, str] | None,
               max_procs: int, memory_bytes: int) -> RunCgroups:
        run = cls()
        name = f"run-{uuid.uuid4().hex}"
        try:
            if pids_base:
                run.pids = os.path.join(pids_base[1], name)
                os.makedirs(run.pids, exist_ok=True)
                _write(run.pids, "pids.max", max_procs)
            if memory_base:
                kind, base = memory_base
                run.memory, run.memory_kind = os.path.join(base, name), kind
                os.makedirs(run.memory, exist_ok=True)
                if kind == "cgroup2":
                    _write(run.memory, "memory.max", memory_bytes)
                    _write(run.memory, "memory.swap.max", 0, optional=True)
                else:
                    _write(run.memory, "memory.limit_in_bytes", memory_bytes)
                    _write(run.memory, "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
        except OSError as error:
            run.sweep()
            raise CgroupError(f"cannot set up the run's cgroups: {error}") from None
        return run

    def pids_limit_hit(self) -> bool | None:
        """A fork or thread was refused by pids.max; None without a pids cgroup."""
        if self.pids is None:
            return None
        return _event(self.pids, "pids.events", "max") > 0

    def memory_limit_hit(self) -> bool | None:
        """The run reached its memory limit and the kernel's OOM killer ended a process of it;
        None without a memory cgroup."""
        if self.memory is None:
            return None
        if self.memory_kind == "cgroup2":
            return _event(self.memory, "memory.events", "oom_kill") > 0
        return _event(self.memory, "memory.oom_control", "oom_kill") > 0

    def sweep(self) -> None:
        """Kills whatever of the run is still alive and removes its cgroups.

        Raises:
          CgroupError: a process survived SIGKILL for a second, or a cgroup cannot be removed.
        """
        for directory in self.dirs:
            for _ in range(200):
                try:
                    with open(os.path.join(directory, "cgroup.procs")) as f:
                        pids = [int(p) for p in f.read().split()]
                    if not pids:
                        os.rmdir(directory)
                        break
                except FileNotFoundError:
                    break
                except OSError as error:
                    if error.errno != errno.EBUSY:
                        raise CgroupError(f"cannot remove the cgroup {directory}: {error}") \
                            from None
                    pids = []
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.005)
            else:
                raise CgroupError(f"processes of {directory} survived SIGKILL for 1 s")


def _write(directory: str, name: str, value: int, optional: bool = False) -> None:
    try:
        with open(os.path.join(directory, name), "w") as f:
            f.write(str(value))
    except FileNotFoundError:
        if not optional:
            raise


def _event(directory: str, name: str, key: str) -> int:
    try:
        with open(os.path.join(directory, name)) as f:
            for row in f:
                parts = row.split()
                if len(parts) == 2 and parts[0] == key:
                    return int(parts[1])
    except (OSError, ValueError):
        pass
    return 0


class UidLease:
    """An uid of [base, base + count) held by no other run on this host, until `release`."""

    def __init__(self, base: int, count: int, lock_dir: str):
        os.makedirs(lock_dir, mode=0o700, exist_ok=True)
        start = random.randrange(count)
        for i in range(count):
            uid = base + (start + i) % count
            fd = os.open(os.path.join(lock_dir, f"uid-{uid}.lock"), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise CgroupError(f"all {count} sandbox uids from {base} are in use; raise uid_count")

    def release(self) -> None:
        os.close(self._fd)


def kill_uid(uid: int) -> None:
    """SIGKILLs every process whose real uid is `uid` (the sweep without a pids cgroup)."""
    for _ in range(100):
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as f:
                    line = next(row for row in f if row.startswith("Uid:"))
                if int(line.split()[1]) == uid:
                    found = True
                    os.kill(int(entry), signal.SIGKILL)
            except (OSError, StopIteration, ValueError):
                continue
        if not found:
            return
        time.sleep(0.005)
