"""Run untrusted Python under kernel isolation: its own uid, namespaces, a private root, Landlock,
seccomp, cgroups and rlimits (docs/environments.md, "python_exec", has the escape table).

`Sandbox(limits).run(args, files, stdin)` runs `python -I -S -B *args` in a fresh working directory
and returns what it printed, how it ended and which limit stopped it. The caller is root (tests and
CI run as root, and resource limits alone do not stop root); every run:

- gets its own **unprivileged uid** from `[uid_base, uid_base + uid_count)`, leased with `flock` so
  that concurrent runs, even from different processes, never share one; supplementary groups are
  dropped and `no_new_privs` is set;
- runs in new **mount, PID, network, IPC and UTS namespaces**: the program is PID 1 of its PID
  namespace, so every process it starts dies with it; the network namespace holds only a downed
  loopback, so nothing is reachable;
- sees a **private root** (`pivot_root` into a tmpfs, the host's tree detached): read-only the
  Python installation, the system library directories, `/etc/ld.so.cache`, `/dev/{null,zero,
  urandom}` and any `read_paths`; its working directory; nothing else: no host socket, no `/proc`,
  no `/tmp`, no run folder;
- is also confined by **Landlock** (ABI >= 1) to those paths (read-write: the working directory
  only; TCP bind/connect denied at ABI >= 4; signals and abstract Unix sockets scoped at ABI >= 6);
- runs under a **seccomp filter** built with libseccomp (`headrace.env.sandbox_seccomp`): no
  namespaces, mounts, ptrace, BPF, keyrings, userfaultfd, io_uring, modules..., and no AF_UNIX,
  AF_NETLINK, AF_PACKET or raw sockets;
- is limited in **process count** (a pids cgroup, else RLIMIT_NPROC, exact because the uid belongs
  to this run alone) and in **memory as a whole** (a memory cgroup, no swap: `memory_limit_hit`
  when its OOM killer ends a process), besides per-process RLIMIT_AS, CPU time (RLIMIT_CPU), file
  size (RLIMIT_FSIZE), open files (RLIMIT_NOFILE), no core dumps, and **wall-clock time** (the host
  asks the bootstrap, over a control pipe, to SIGKILL the namespace's PID 1, which takes every
  process in it down; if the host dies the pipe closes and the same happens; PR_SET_PDEATHSIG and
  a sweep by cgroup or uid catch the rest);
- writes only to a size-limited tmpfs (noexec, nosuid, nodev), visible only inside the run; stdout
  and stderr are capped (the rest is drained and counted, never buffered).

A host lacking a mechanism gets `SandboxUnavailable` with the reason at construction (`probe()`
checks once per process, including one confined self-test run); nothing runs unconfined. Where no
cgroup is writable, rlimits stand in (`Mechanisms` says which). A failure of the sandbox machinery
itself raises `SandboxError`; a misbehaving program never raises, its `RunResult` says what
happened. The bootstrap (`headrace.env.sandbox_boot`) runs as a root child process.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from headrace.env import sandbox_boot as boot
from headrace.env.sandbox_boot import LL_EXECUTE, LL_READ, LL_READ_FILE, LL_WRITE_FILE, landlock_abi
from headrace.env.sandbox_cgroups import CgroupError, RunCgroups, UidLease, find_base, kill_uid
from headrace.env.sandbox_io import collect, drain, stop
from headrace.env.sandbox_seccomp import SeccompUnavailable, build_filter
from headrace.env.sandbox_types import (
    Mechanisms,
    RunResult,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
)

_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")
_SYSTEM_LIB_DIRS = ("/lib", "/lib64", "/lib32", "/usr/lib", "/usr/lib64", "/usr/lib32")
_DEVICES = (("/dev/null", LL_READ_FILE | LL_WRITE_FILE), ("/dev/zero", LL_READ_FILE),
            ("/dev/urandom", LL_READ_FILE))
WORK = "/work"  # the working directory, inside the run's root
__all__ = ["Mechanisms", "RunResult", "Sandbox", "SandboxError", "SandboxLimits",
           "SandboxUnavailable", "landlock_abi", "probe"]


_probe_lock = threading.Lock()
_probed: Mechanisms | SandboxUnavailable | None = None
_filter: bytes | None = None

_SELF_TEST = """
import json, os, socket
report = {"uid": os.getuid()}
for path in ("/etc/hostname", "/etc/passwd", "/proc/self/status"):
    try:
        open(path).read(1)
        report[path] = "read"
    except OSError as error:
        report[path] = type(error).__name__
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1).close()
    report["net"] = "connected"
except OSError as error:
    report["net"] = type(error).__name__
try:
    socket.socket(socket.AF_UNIX).close()
    report["unix"] = "connected"
except OSError as error:
    report["unix"] = type(error).__name__
print(json.dumps(report))
"""


def probe() -> Mechanisms:
    """Checks, once per process, that every mechanism works here, with one confined self-test run.

    Raises:
      SandboxUnavailable: not root, no Landlock, no libseccomp, namespaces refused, or the
        self-test shows a leak.
    """
    global _probed
    with _probe_lock:
        if _probed is None:
            try:
                _probed = _probe_uncached()
            except SandboxUnavailable as error:
                _probed = error
        if isinstance(_probed, SandboxUnavailable):
            raise SandboxUnavailable(str(_probed))
        return _probed


def _seccomp_filter() -> bytes:
    global _filter
    if _filter is None:
        _filter = build_filter()
    return _filter


def _probe_uncached() -> Mechanisms:
    if sys.platform != "linux":
        raise SandboxUnavailable(f"the sandbox needs Linux, this is {sys.platform}")
    if os.geteuid() != 0:
        raise SandboxUnavailable("the sandbox needs root (to create namespaces, mount the "
                                 "working directory and drop to an unprivileged uid); run the "
                                 "actor as root, e.g. in a container")
    abi = landlock_abi()
    if abi < 1:
        raise SandboxUnavailable("Landlock is unavailable (kernel < 5.13, or 'landlock' missing "
                                 "from the lsm= boot parameter): file access cannot be confined, "
                                 "refusing to run untrusted code")
    if os.uname().machine not in boot.SYS_PIVOT_ROOT:
        raise SandboxUnavailable(f"the sandbox does not know pivot_root on {os.uname().machine}")
    try:
        _seccomp_filter()
    except SeccompUnavailable as error:
        raise SandboxUnavailable(str(error)) from None
    pids, memory = find_base("pids"), find_base("memory")
    mechanisms = Mechanisms(landlock_abi=abi, pids=pids[0] if pids else "rlimit",
                            pids_base=pids[1] if pids else None,
                            memory=memory[0] if memory else "rlimit",
                            memory_base=memory[1] if memory else None)
    sandbox = Sandbox(SandboxLimits(wall_s=10.0), _mechanisms=mechanisms)
    try:
        result = sandbox.run(["-c", _SELF_TEST])
    except SandboxError as error:
        raise SandboxUnavailable(f"the sandbox self-test could not start: {error}") from None
    try:
        report = json.loads(result.stdout)
    except ValueError:
        raise SandboxUnavailable("the sandbox self-test failed: exit "
                                 f"{result.exit_code}, signal {result.signal}, stderr "
                                 f"{result.stderr[-500:].decode(errors='replace')!r}") from None
    leaks = [key for key, value in report.items() if value in ("read", "connected")]
    if report.get("uid") == 0 or leaks:
        raise SandboxUnavailable(f"the sandbox self-test was not confined: {report}")
    return mechanisms


def _python_layout() -> tuple[str, str, str | None, str | None]:
    """(interpreter, standard library directory, libpython, dynamic loader) of this Python.

    libpython and the loader are None for a static interpreter. The loader needs Landlock's
    execute right: the kernel opens it for execution when it starts the interpreter.
    """
    executable = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    stdlib = os.path.dirname(os.path.realpath(os.__file__))
    libpython = loader = None
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            name = os.path.basename(path)
            if name.startswith("libpython") and os.path.exists(path):
                libpython = path
            elif name.startswith("ld-") and ".so" in name and os.path.exists(path):
                loader = path
    return executable, stdlib, libpython, loader


class Sandbox:
    """Runs Python programs confined as described in the module docstring; thread-safe.

    Args:
      limits: the limits of every run (default: `SandboxLimits()`).
      uid_base, uid_count: the range of unprivileged uids runs are given (one per concurrent run);
        nothing else on the host should use them.
      read_paths: extra directories or files the program may read (e.g. a data directory); they
        appear read-only at the same paths inside.

    Raises:
      SandboxUnavailable: a mechanism is missing on this host (see `probe`).
    """

    def __init__(self, limits: SandboxLimits | None = None, *, uid_base: int = 1_800_000,
                 uid_count: int = 1024, read_paths: tuple[str, ...] = (), _mechanisms=None):
        self.limits = limits or SandboxLimits()
        self.mechanisms: Mechanisms = _mechanisms or probe()
        self.uid_base, self.uid_count = uid_base, uid_count
        self.read_paths = tuple(os.path.realpath(p) for p in read_paths)
        self._python = _python_layout()
        lock_root = "/run" if os.access("/run", os.W_OK) else tempfile.gettempdir()
        self._lock_dir = os.path.join(lock_root, "headrace-sandbox")

    def run(self, args: list[str], files: dict[str, str] | None = None,
            stdin: bytes = b"") -> RunResult:
        """Runs `python -I -S -B *args` in a fresh working directory holding `files`.

        Args:
          args: interpreter arguments, e.g. ["main.py"] or ["-c", source].
          files: name -> text written into the working directory (flat names only).
          stdin: bytes fed to the program's standard input.

        Raises:
          ValueError: a file name that is not a plain name.
          SandboxError: the sandbox could not be set up (the program did not run).
        """
        files = dict(files or {})
        for name in files:
            if not _FILE_NAME.match(name):
                raise ValueError(f"sandbox file name {name!r} must match {_FILE_NAME.pattern}")
        started = time.monotonic()
        run_dir = tempfile.mkdtemp(prefix="headrace-sbx-")
        try:
            lease = UidLease(self.uid_base, self.uid_count, self._lock_dir)
        except CgroupError as error:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise SandboxError(str(error)) from None
        cgroups = RunCgroups()
        try:
            os.mkdir(os.path.join(run_dir, "root"), 0o755)
            config = self._layout(run_dir, lease.uid, files, args)
            m, limits = self.mechanisms, self.limits
            cgroups = RunCgroups.create(
                (m.pids, m.pids_base) if m.pids_base else None,
                (m.memory, m.memory_base) if m.memory_base else None,
                limits.max_procs, limits.total_memory_mb << 20)
            config["cgroups"] = cgroups.dirs
            return self._execute(config, stdin, started, cgroups)
        except CgroupError as error:
            raise SandboxError(str(error)) from None
        finally:
            try:
                if cgroups.pids is None:
                    kill_uid(lease.uid)
                cgroups.sweep()
            except CgroupError as error:
                raise SandboxError(str(error)) from None
            finally:
                lease.release()
                shutil.rmtree(run_dir, ignore_errors=True)

    def _layout(self, run_dir: str, uid: int, files: dict[str, str], args: list[str]) -> dict:
        """The bootstrap's configuration: what the private root holds, limits, rules, argv."""
        executable, stdlib, libpython, loader = self._python
        lib = "/py/lib"
        binds = [(executable, "/py/bin/python3", False),
                 (stdlib, f"{lib}/{os.path.basename(stdlib)}", False)]
        if libpython:
            binds.append((libpython, f"{lib}/{os.path.basename(libpython)}", False))
        links = []
        for path in _SYSTEM_LIB_DIRS:
            if os.path.islink(path):
                links.append((path, os.readlink(path)))
            elif os.path.isdir(path):
                binds.append((path, path, False))
        binds += [(p, p, False) for p in ("/etc/ld.so.cache", *self.read_paths)
                  if os.path.exists(p)]
        binds += [(p, p, True) for p, _ in _DEVICES if os.path.exists(p)]
        rules = [("/py", LL_READ | LL_EXECUTE), (WORK, (1 << 16) - 1 & ~LL_EXECUTE)]
        rules += [(path, LL_READ) for source, path, device in binds
                  if not device and not path.startswith("/py/")]
        rules += [(p, access) for p, access in _DEVICES if os.path.exists(p)]
        if loader:
            rules.append((loader, LL_READ_FILE | LL_EXECUTE))
        limits = self.limits
        m = self.mechanisms
        return {
            "root": os.path.join(run_dir, "root"), "links": links, "binds": binds,
            "work": WORK, "uid": uid, "files": files,
            "tmpfs": f"size={limits.disk_mb}m,nr_inodes=4096,mode=0700,uid={uid},gid={uid}",
            "rlimits": {"RLIMIT_AS": limits.memory_mb << 20,
                        "RLIMIT_CPU": [limits.cpu_s, limits.cpu_s + 1],
                        "RLIMIT_FSIZE": limits.file_mb << 20,
                        "RLIMIT_NOFILE": limits.max_open_files,
                        # With a pids cgroup, RLIMIT_NPROC is only a backstop, so that the
                        # cgroup (which reports hits) is the limit that bites.
                        "RLIMIT_NPROC": limits.max_procs * (2 if m.pids_base else 1),
                        "RLIMIT_CORE": 0},
            "landlock_abi": m.landlock_abi, "rules": rules,
            "seccomp": base64.b64encode(_seccomp_filter()).decode() if m.seccomp else "",
            "argv": ["/py/bin/python3", "-I", "-S", "-B", *args],
            "env": {"PATH": "/usr/bin:/bin", "HOME": WORK, "TMPDIR": WORK, "LANG": "C.UTF-8",
                    "LD_LIBRARY_PATH": lib},
        }

    def _execute(self, config: dict, stdin: bytes, started: float,
                 cgroups: RunCgroups) -> RunResult:
        status_r, status_w = os.pipe()
        control_r, control_w = os.pipe()
        config["status_fd"], config["control_fd"] = status_w, control_r
        try:
            # The configuration (program files included) goes through a root-only file: argv is
            # limited to 128 KiB per argument.
            config_path = os.path.join(os.path.dirname(config["root"]), "config.json")
            with open(os.open(config_path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600), "w") as f:
                json.dump(config, f)
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", os.path.abspath(boot.__file__), config_path],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(status_w, control_r), start_new_session=True, cwd="/",
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        except OSError as error:
            for fd in (status_r, control_w):
                os.close(fd)
            raise SandboxError(f"cannot start the sandbox bootstrap: {error}") from None
        finally:
            os.close(status_w)
            os.close(control_r)
        deadline = started + self.limits.wall_s
        with os.fdopen(status_r, "rb") as status_file, os.fdopen(control_w, "wb") as control:
            streams, timed_out, output_limited = collect(
                proc, stdin, status_file, deadline, self.limits.output_bytes,
                self.limits.kill_output_bytes)
            if timed_out or output_limited:
                stop(proc, control)
            proc.wait()
            streams["status"][0] += drain(status_file)
        status = streams["status"][0].decode(errors="replace").strip().splitlines()
        for line in status:
            if line.startswith(boot.STATUS_SETUP_ERROR):
                raise SandboxError("sandbox setup failed: "
                                   f"{line[len(boot.STATUS_SETUP_ERROR) + 1:]}")
        kind, _, value = (status[-1] if status else "").partition(" ")
        if kind not in (boot.STATUS_EXIT, boot.STATUS_SIGNAL) and not (timed_out or output_limited):
            raise SandboxError(f"the sandbox bootstrap died (returncode {proc.returncode}): "
                               f"{streams['stderr'][0][-500:].decode(errors='replace')}")
        exit_code = int(value) if kind == boot.STATUS_EXIT and not timed_out else None
        sig = int(value) if kind == boot.STATUS_SIGNAL else None
        if timed_out or (output_limited and exit_code is None):
            sig = int(signal.SIGKILL)
        return RunResult(exit_code=exit_code, signal=sig, timed_out=timed_out,
                         stdout=streams["stdout"][0], stderr=streams["stderr"][0],
                         stdout_total=streams["stdout"][1], stderr_total=streams["stderr"][1],
                         wall_s=time.monotonic() - started,
                         pids_limit_hit=cgroups.pids_limit_hit(), output_limited=output_limited,
                         memory_limit_hit=cgroups.memory_limit_hit())
