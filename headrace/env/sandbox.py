"""Run untrusted Python under kernel isolation: its own uid, namespaces, Landlock, limits.

`Sandbox(limits).run(args, files, stdin)` runs `python -I -S -B *args` in a fresh temporary working
directory and returns what it printed, how it ended and which limit stopped it. The caller is root
(tests and CI run as root, and resource limits alone do not stop root); every run:

- gets its own **unprivileged uid** from `[uid_base, uid_base + uid_count)`, leased with `flock` so
  that concurrent runs, even from different processes, never share one; supplementary groups are
  dropped and `no_new_privs` is set;
- runs in new **mount, PID, network, IPC and UTS namespaces** (`unshare(2)` through ctypes, then a
  fork): the program is PID 1 of its PID namespace, so every process it starts dies with it; the
  network namespace holds only a downed loopback, so nothing is reachable;
- is confined by **Landlock** (ABI >= 1): read-only access to the Python installation (bind-mounted
  read-only into the run directory: the interpreter, its standard library and libpython), the
  system shared-library directories, `/etc/ld.so.cache` and `/dev/{null,zero,urandom}`; read-write
  access to the working directory only; TCP bind/connect denied (ABI >= 4); signals and abstract
  Unix sockets scoped to the sandbox (ABI >= 6). File metadata (`stat`) is not hidden;
- is limited in **process count** by a pids cgroup (v2, else v1) with `pids.max`, or, where no pids
  cgroup is writable, by RLIMIT_NPROC, exact because the uid belongs to this run alone;
- is limited in memory (RLIMIT_AS), CPU time (RLIMIT_CPU), file size (RLIMIT_FSIZE), open files
  (RLIMIT_NOFILE), no core dumps, and **wall-clock time** (the host asks the bootstrap, over a
  control pipe, to SIGKILL the namespace's PID 1, which takes every process in it down; if the
  host dies the pipe closes and the same happens; PR_SET_PDEATHSIG and a sweep by cgroup or uid
  catch the rest);
- writes only to a size-limited tmpfs (noexec, nosuid, nodev) mounted on the working directory and
  visible only inside the run; its host mountpoint is removed afterwards; stdout and stderr are
  capped (the rest is drained and counted, never buffered).

A host lacking a mechanism gets `SandboxUnavailable` with the reason at construction (`probe()`
checks once per process, including one confined self-test run); nothing runs unconfined. A
failure of the sandbox machinery itself raises `SandboxError`; a misbehaving program never raises,
its `RunResult` says what happened.

This file is also the bootstrap: the host runs it as a script, as root (`python -I -S sandbox.py
CONFIG_FILE`), so it imports only the standard library.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import json
import os
import random
import re
import resource
import select
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid

# unshare(2) and mount(2) flags, prctl options (linux/sched.h, linux/mount.h, linux/prctl.h).
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
# Landlock (linux/landlock.h); the syscall numbers are the same on every architecture.
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LL_EXECUTE, LL_WRITE_FILE, LL_READ_FILE, LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
LL_TRUNCATE, LL_IOCTL_DEV = 1 << 14, 1 << 15
LL_FILE_RIGHTS = LL_EXECUTE | LL_WRITE_FILE | LL_READ_FILE | LL_TRUNCATE | LL_IOCTL_DEV
LL_READ = LL_READ_FILE | LL_READ_DIR

STATUS_EXIT, STATUS_SIGNAL, STATUS_SETUP_ERROR = "exit", "signal", "setup-error"
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")
_SYSTEM_LIB_DIRS = ("/lib", "/lib64", "/lib32", "/usr/lib", "/usr/lib64", "/usr/lib32")
_DEVICES = (("/dev/null", LL_READ_FILE | LL_WRITE_FILE), ("/dev/zero", LL_READ_FILE),
            ("/dev/urandom", LL_READ_FILE))


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

    def __post_init__(self):
        for key in ("wall_s", "cpu_s", "memory_mb", "max_procs", "disk_mb", "file_mb",
                    "max_open_files", "output_bytes", "kill_output_bytes"):
            if not getattr(self, key) > 0:
                raise ValueError(f"SandboxLimits.{key}={getattr(self, key)!r} must be > 0")


@dataclasses.dataclass(frozen=True)
class Mechanisms:
    """What `probe()` found on this host."""

    landlock_abi: int  # Landlock ABI version (>= 1)
    pids: str  # "cgroup2" | "cgroup1" | "rlimit": how the process count is limited
    pids_base: str | None  # the cgroup directory runs are created under, if any


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

    @property
    def output_truncated(self) -> bool:
        return len(self.stdout) < self.stdout_total or len(self.stderr) < self.stderr_total

    @property
    def cpu_limited(self) -> bool:
        return self.signal in (signal.SIGXCPU, signal.SIGKILL) and not self.timed_out

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


# ----------------------------------------------------------------------------------- host side

_probe_lock = threading.Lock()
_probed: Mechanisms | SandboxUnavailable | None = None

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
print(json.dumps(report))
"""


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is missing or disabled."""
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                       ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(int(abi), 0)


def _cgroup_mounts() -> list[tuple[str, str, str]]:
    with open("/proc/self/mounts") as f:
        rows = [line.split() for line in f]
    return [(row[1], row[2], row[3]) for row in rows
            if len(row) >= 4 and row[2].startswith("cgroup")]


def _pids_cgroup() -> tuple[str, str] | None:
    """("cgroup2" | "cgroup1", base directory) where runs can get a pids.max, else None."""
    for mount, fstype, options in _cgroup_mounts():
        if fstype == "cgroup2":
            try:
                with open(os.path.join(mount, "cgroup.controllers")) as f:
                    if "pids" not in f.read().split():
                        continue
                with open(os.path.join(mount, "cgroup.subtree_control"), "w") as f:
                    f.write("+pids")
                kind = "cgroup2"
            except OSError:
                continue
        elif "pids" in options.split(","):
            kind = "cgroup1"
        else:
            continue
        base = os.path.join(mount, "headrace-sandbox")
        try:
            os.makedirs(base, exist_ok=True)
            if kind == "cgroup2":
                with open(os.path.join(base, "cgroup.subtree_control"), "w") as f:
                    f.write("+pids")
            trial = os.path.join(base, f"probe-{uuid.uuid4().hex[:8]}")
            os.mkdir(trial)
            try:
                with open(os.path.join(trial, "pids.max"), "w") as f:
                    f.write("8")
            finally:
                os.rmdir(trial)
            return kind, base
        except OSError:
            continue
    return None


def probe() -> Mechanisms:
    """Checks, once per process, that every mechanism works here, with one confined self-test run.

    Raises:
      SandboxUnavailable: not root, no Landlock, namespaces refused, or the self-test shows a leak.
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
    found = _pids_cgroup()
    mechanisms = Mechanisms(landlock_abi=abi, pids=found[0] if found else "rlimit",
                            pids_base=found[1] if found else None)
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


class _UidLease:
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
        raise SandboxError(f"all {count} sandbox uids from {base} are in use; raise uid_count")

    def release(self) -> None:
        os.close(self._fd)


class Sandbox:
    """Runs Python programs confined as described in the module docstring; thread-safe.

    Args:
      limits: the limits of every run.
      uid_base, uid_count: the range of unprivileged uids runs are given (one per concurrent run);
        nothing else on the host should use them.
      read_paths: extra directories or files the program may read (e.g. a data directory).

    Raises:
      SandboxUnavailable: a mechanism is missing on this host (see `probe`).
    """

    def __init__(self, limits: SandboxLimits = SandboxLimits(), *, uid_base: int = 1_800_000,
                 uid_count: int = 1024, read_paths: tuple[str, ...] = (), _mechanisms=None):
        self.limits = limits
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
        lease = _UidLease(self.uid_base, self.uid_count, self._lock_dir)
        cgroup = None
        try:
            os.chmod(run_dir, 0o711)
            config = self._layout(run_dir, lease.uid, files, args)
            cgroup = self._make_cgroup()
            config["cgroup"] = cgroup
            return self._execute(config, stdin, started, cgroup)
        finally:
            self._sweep(cgroup, lease.uid)
            lease.release()
            shutil.rmtree(run_dir, ignore_errors=True)

    def _layout(self, run_dir: str, uid: int, files: dict[str, str], args: list[str]) -> dict:
        executable, stdlib, libpython, loader = self._python
        work, py = os.path.join(run_dir, "work"), os.path.join(run_dir, "py")
        lib = os.path.join(py, "lib")
        os.makedirs(os.path.join(py, "bin"), mode=0o755)
        os.makedirs(os.path.join(lib, os.path.basename(stdlib)), mode=0o755)
        os.mkdir(work, 0o700)
        binds = [(executable, os.path.join(py, "bin", "python3")),
                 (stdlib, os.path.join(lib, os.path.basename(stdlib)))]
        if libpython:
            binds.append((libpython, os.path.join(lib, os.path.basename(libpython))))
        for source, target in binds:
            if not os.path.isdir(source):
                open(target, "w").close()
        for path in (run_dir, py, os.path.join(py, "bin"), lib):
            os.chmod(path, 0o711 if path == run_dir else 0o755)
        limits = self.limits
        rules = [(py, LL_READ | LL_EXECUTE), (work, (1 << 16) - 1 & ~LL_EXECUTE)]
        rules += [(p, LL_READ) for p in _SYSTEM_LIB_DIRS + ("/etc/ld.so.cache",) + self.read_paths
                  if os.path.exists(p)]
        rules += [(p, access) for p, access in _DEVICES if os.path.exists(p)]
        if loader:
            rules.append((loader, LL_READ_FILE | LL_EXECUTE))
        return {
            "work": work, "binds": binds, "uid": uid, "files": files,
            "tmpfs": f"size={limits.disk_mb}m,nr_inodes=4096,mode=0700,uid={uid},gid={uid}",
            "rlimits": {"RLIMIT_AS": limits.memory_mb << 20,
                        "RLIMIT_CPU": [limits.cpu_s, limits.cpu_s + 1],
                        "RLIMIT_FSIZE": limits.file_mb << 20,
                        "RLIMIT_NOFILE": limits.max_open_files,
                        # With a pids cgroup, RLIMIT_NPROC is only a backstop, so that the
                        # cgroup (which reports hits) is the limit that bites.
                        "RLIMIT_NPROC": limits.max_procs * (2 if self.mechanisms.pids_base else 1),
                        "RLIMIT_CORE": 0},
            "landlock_abi": self.mechanisms.landlock_abi, "rules": rules,
            "argv": [os.path.join(py, "bin", "python3"), "-I", "-S", "-B", *args],
            "env": {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
                    "LD_LIBRARY_PATH": lib},
        }

    def _make_cgroup(self) -> str | None:
        base = self.mechanisms.pids_base
        if base is None:
            return None
        path = os.path.join(base, f"run-{uuid.uuid4().hex}")
        try:
            os.mkdir(path)
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(self.limits.max_procs))
        except OSError as error:
            raise SandboxError(f"cannot create the pids cgroup {path}: {error}") from None
        return path

    def _execute(self, config: dict, stdin: bytes, started: float, cgroup: str | None) -> RunResult:
        status_r, status_w = os.pipe()
        control_r, control_w = os.pipe()
        config["status_fd"], config["control_fd"] = status_w, control_r
        try:
            # The configuration (program files included) goes through a root-only file: argv is
            # limited to 128 KiB per argument.
            config_path = os.path.join(os.path.dirname(config["work"]), "config.json")
            with open(os.open(config_path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600), "w") as f:
                json.dump(config, f)
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), config_path],
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
            streams, timed_out, output_limited = _collect(
                proc, stdin, status_file, deadline, self.limits.output_bytes,
                self.limits.kill_output_bytes)
            if timed_out or output_limited:
                _stop(proc, control)
            proc.wait()
            streams["status"][0] += _drain(status_file)
        status = streams["status"][0].decode(errors="replace").strip().splitlines()
        for line in status:
            if line.startswith(STATUS_SETUP_ERROR):
                raise SandboxError(f"sandbox setup failed: {line[len(STATUS_SETUP_ERROR) + 1:]}")
        kind, _, value = (status[-1] if status else "").partition(" ")
        if kind not in (STATUS_EXIT, STATUS_SIGNAL) and not (timed_out or output_limited):
            raise SandboxError(f"the sandbox bootstrap died (returncode {proc.returncode}): "
                               f"{streams['stderr'][0][-500:].decode(errors='replace')}")
        exit_code = int(value) if kind == STATUS_EXIT and not timed_out else None
        sig = int(value) if kind == STATUS_SIGNAL else None
        if timed_out or (output_limited and exit_code is None):
            sig = int(signal.SIGKILL)
        return RunResult(exit_code=exit_code, signal=sig, timed_out=timed_out,
                         stdout=streams["stdout"][0], stderr=streams["stderr"][0],
                         stdout_total=streams["stdout"][1], stderr_total=streams["stderr"][1],
                         wall_s=time.monotonic() - started, pids_limit_hit=_pids_hit(cgroup),
                         output_limited=output_limited)

    def _sweep(self, cgroup: str | None, uid: int) -> None:
        """Kills whatever of this run is still alive and removes its cgroup."""
        if cgroup is None:
            _kill_uid(uid)
            return
        for _ in range(200):
            try:
                with open(os.path.join(cgroup, "cgroup.procs")) as f:
                    pids = [int(p) for p in f.read().split()]
                if not pids:
                    os.rmdir(cgroup)
                    return
            except FileNotFoundError:
                return
            except OSError as error:
                if error.errno != errno.EBUSY:
                    raise SandboxError(f"cannot remove the pids cgroup {cgroup}: {error}") from None
                pids = []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.005)
        raise SandboxError(f"processes of {cgroup} survived SIGKILL for 1 s")


def _collect(proc: subprocess.Popen, stdin: bytes, status_file, deadline: float, cap: int,
             kill_cap: int) -> tuple[dict[str, list], bool, bool]:
    """Feeds stdin and reads stdout, stderr and the status pipe until all close, `deadline`
    passes (timed out) or the program's output passes `kill_cap` (output limited)."""
    streams: dict[str, list] = {"stdout": [b"", 0], "stderr": [b"", 0], "status": [b"", 0]}
    selector = selectors.DefaultSelector()
    for name, file in (("stdout", proc.stdout), ("stderr", proc.stderr), ("status", status_file)):
        os.set_blocking(file.fileno(), False)
        selector.register(file, selectors.EVENT_READ, name)
    pending = memoryview(stdin)
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        selector.register(proc.stdin, selectors.EVENT_WRITE, "stdin")
    else:
        proc.stdin.close()
    timed_out = output_limited = False
    try:
        while selector.get_map() and not output_limited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in selector.select(min(remaining, 0.5)):
                if key.data == "stdin":
                    try:
                        pending = pending[os.write(key.fd, pending[:65536]):]
                    except (BrokenPipeError, BlockingIOError) as error:
                        if isinstance(error, BlockingIOError):
                            continue
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(key.fileobj)
                        key.fileobj.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                kept, total = streams[key.data]
                limit = cap if key.data != "status" else 1 << 16
                streams[key.data] = [kept + chunk[:max(0, limit - len(kept))], total + len(chunk)]
                output_limited = streams["stdout"][1] + streams["stderr"][1] > kill_cap
    finally:
        selector.close()
        for file in (proc.stdin, proc.stdout, proc.stderr):
            if not file.closed:
                file.close()
    return streams, timed_out, output_limited


def _stop(proc: subprocess.Popen, control) -> None:
    """Asks the bootstrap to SIGKILL the program (PID 1 of its namespace, so everything in it
    dies and is reaped there); SIGKILLs the bootstrap's process group if it has not ended in 2 s."""
    try:
        control.write(b"k")
        control.flush()
    except OSError:
        pass
    try:
        proc.wait(2.0)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _drain(file) -> bytes:
    """What is left in a non-blocking pipe, without waiting for writers."""
    data = b""
    while len(data) < 1 << 16:
        try:
            chunk = os.read(file.fileno(), 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return data


def _kill_uid(uid: int) -> None:
    """SIGKILLs every process whose real uid is `uid` (the rlimit-mode sweep)."""
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


def _pids_hit(cgroup: str | None) -> bool | None:
    if cgroup is None:
        return None
    try:
        with open(os.path.join(cgroup, "pids.events")) as f:
            return any(row.split()[0] == "max" and int(row.split()[1]) > 0 for row in f)
    except (OSError, ValueError, IndexError):
        return False


# ------------------------------------------------- bootstrap (runs as root, then drops privileges)

def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_char_p]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                           ctypes.c_ulong]
    return libc


def _check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def _mount(libc, source, target, fstype, flags, data=None) -> None:
    encode = lambda s: s.encode() if s is not None else None
    _check(libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)),
           f"mount {source} on {target}")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _landlock(libc, abi: int, rules: list) -> None:
    """Restricts this process (and what it execs) to `rules`: [(path, access bits)]."""
    handled_fs = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (LL_TRUNCATE if abi >= 3 else 0)
    handled_fs |= LL_IOCTL_DEV if abi >= 5 else 0
    attr = _RulesetAttr(handled_fs, 0b11 if abi >= 4 else 0, 0b11 if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = _check(libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), ctypes.byref(attr),
                                  ctypes.c_size_t(size), ctypes.c_uint32(0)), "landlock ruleset")
    for path, access in rules:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            access &= handled_fs
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                access &= LL_FILE_RIGHTS
            rule = _PathBeneathAttr(access, fd)
            _check(libc.syscall(ctypes.c_long(SYS_LANDLOCK_ADD_RULE), ctypes.c_int(ruleset),
                                ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0)),
                   f"landlock rule {path}")
        finally:
            os.close(fd)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(libc.syscall(ctypes.c_long(SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset),
                        ctypes.c_uint32(0)), "landlock restrict_self")
    os.close(ruleset)


def _boot(config: dict) -> None:
    """The bootstrap: new namespaces, fork; the child confines itself and execs the program.

    The parent stays outside the new PID namespace, waits (killing the child when the host asks on
    the control pipe), and reports the child's end on the status pipe ("exit N" or "signal S");
    the child reports "setup-error ..." if confinement fails.
    """
    status_fd = config["status_fd"]
    libc = _libc()
    report = lambda line: os.write(status_fd, (line + "\n").encode())
    try:
        # No parent-death signal here: if the host dies, the control pipe closes and this process
        # kills and reaps the child itself (so no zombie of the sandbox's uid is left behind).
        flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
        _check(libc.unshare(flags), "unshare")
        _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
        pid = os.fork()
    except OSError as error:
        report(f"{STATUS_SETUP_ERROR} {error}")
        os._exit(1)
    if pid == 0:
        try:
            _confine(libc, config)
        except BaseException as error:  # noqa: BLE001 - any failure must reach the host
            report(f"{STATUS_SETUP_ERROR} {type(error).__name__}: {error}")
            os._exit(125)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    # Wait for the child; a byte on (or the closing of) the control pipe means "kill it". Only
    # this process may reap the child, so its pid cannot be reused before the kill.
    child, control = os.pidfd_open(pid), config["control_fd"]
    watched = [child, control]
    while child not in select.select(watched, [], [])[0]:
        os.kill(pid, signal.SIGKILL)
        watched = [child]
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        report(f"{STATUS_SIGNAL} {os.WTERMSIG(status)}")
    else:
        report(f"{STATUS_EXIT} {os.WEXITSTATUS(status)}")
    os._exit(0)


def _confine(libc, config: dict) -> None:
    """In the child (PID 1 of the new namespace, still root): confine, drop to the uid, exec."""
    if config["cgroup"]:
        with open(os.path.join(config["cgroup"], "cgroup.procs"), "w") as f:
            f.write("0")
    work, uid = config["work"], config["uid"]
    _mount(libc, "tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, config["tmpfs"])
    for source, target in config["binds"]:
        _mount(libc, source, target, None, MS_BIND)
        _mount(libc, None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    for name, text in config["files"].items():
        path = os.path.join(work, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        os.chown(path, uid, uid)
    os.chdir(work)
    for name, value in config["rlimits"].items():
        soft, hard = value if isinstance(value, list) else (value, value)
        resource.setrlimit(getattr(resource, name), (soft, hard))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    _landlock(libc, config["landlock_abi"], config["rules"])
    status_fd = config["status_fd"]
    os.set_inheritable(status_fd, False)
    os.closerange(3, status_fd)
    os.closerange(status_fd + 1, 65536)
    os.execve(config["argv"][0], config["argv"], config["env"])


if __name__ == "__main__":
    with open(sys.argv[1]) as config_file:
        _boot(json.load(config_file))
