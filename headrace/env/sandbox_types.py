"""The sandbox's limits, what a host offers, how a run ended, and its errors
(`headrace.env.sandbox` re-exports them all)."""

from __future__ import annotations

import dataclasses
import signal


class SandboxUnavailable(RuntimeError):
    """This host lacks a mechanism the sandbox needs; the message names it and what to do."""


class SandboxError(RuntimeError):
    """The sandbox machinery failed (not the program inside it); the message says where."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run; the defaults suit small function-writing tasks."""

    wall_s: float = 5.0  # wall-clock limit of the whole run, setup included
    cpu_s: int = 5  # CPU seconds per process (SIGXCPU, then SIGKILL one second later)
    memory_mb: int = 512  # address space per process (RLIMIT_AS)
    max_procs: int = 16  # processes and threads at once (pids cgroup or RLIMIT_NPROC)
    disk_mb: int = 16  # size of the working-directory tmpfs
    file_mb: int = 8  # largest file the program may write (RLIMIT_FSIZE)
    max_open_files: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 65536  # kept per stream (stdout, stderr); the rest is counted and dropped
    kill_output_bytes: int = 4 << 20  # stdout + stderr beyond this: the run is killed
    total_memory_mb: int = 768  # the whole run's memory, tmpfs included (memory cgroup)

    def __post_init__(self):
        for key in ("wall_s", "cpu_s", "memory_mb", "max_procs", "disk_mb", "file_mb",
                    "max_open_files", "output_bytes", "kill_output_bytes", "total_memory_mb"):
            if not getattr(self, key) > 0:
                raise ValueError(f"SandboxLimits.{key}={getattr(self, key)!r} must be > 0")
        if self.total_memory_mb < self.disk_mb + 32:
            raise ValueError(f"SandboxLimits.total_memory_mb={self.total_memory_mb} must be >= "
                             f"disk_mb + 32 = {self.disk_mb + 32} (the tmpfs counts)")


@dataclasses.dataclass(frozen=True)
class Mechanisms:
    """What `probe()` found on this host."""

    landlock_abi: int  # Landlock ABI version (>= 1)
    pids: str  # "cgroup2" | "cgroup1" | "rlimit": how the process count is limited
    pids_base: str | None  # the cgroup directory runs are created under, if any
    memory: str = "rlimit"  # "cgroup2" | "cgroup1" | "rlimit" (RLIMIT_AS per process only)
    memory_base: str | None = None
    seccomp: bool = True  # False only in tests that show what the filter stops


@dataclasses.dataclass
class RunResult:
    """How one sandboxed run ended. `exit_code` is None when the program died of a signal."""

    exit_code: int | None
    signal: int | None
    timed_out: bool  # killed by the wall-clock limit
    stdout: bytes  # the first `output_bytes` of stdout
    stderr: bytes
    stdout_total: int  # bytes the program wrote to stdout, kept or not
    stderr_total: int
    wall_s: float
    # A fork or thread creation was refused by the process limit; None where unknown (rlimit mode).
    pids_limit_hit: bool | None
    output_limited: bool = False  # killed for writing more than `kill_output_bytes`
    # The whole run reached `total_memory_mb` and a process was OOM-killed; None: no memory cgroup.
    memory_limit_hit: bool | None = None

    @property
    def output_truncated(self) -> bool:
        return len(self.stdout) < self.stdout_total or len(self.stderr) < self.stderr_total

    @property
    def cpu_limited(self) -> bool:
        return self.signal in (signal.SIGXCPU, signal.SIGKILL) and not self.timed_out \
            and not self.memory_limit_hit

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out
