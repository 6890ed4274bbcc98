"""The sandbox's bootstrap: runs as root (`python -I -S sandbox_boot.py CONFIG_FILE`), confines
itself and execs the untrusted program (docs/environments.md, "python_exec").

It imports only the standard library: it runs without site-packages. The host
(`headrace.env.sandbox`) prepares everything it needs, the seccomp program included (built there
with libseccomp), and hands it over in a root-only JSON file.

Steps: new mount, PID, network, IPC and UTS namespaces, then a fork. The child (PID 1 of the new
PID namespace, still root) joins the run's cgroups, builds a **private root**: a small tmpfs
holding only read-only bind mounts of the Python installation, the system library directories,
`/etc/ld.so.cache` and `/dev/{null,zero,urandom}`, plus the size-limited working tmpfs, then
`pivot_root`s into it and detaches the host's tree, so no host path, socket or `/proc` exists
for the program at all. It then sets its rlimits, drops to the run's unprivileged uid, restricts
itself with Landlock and loads the seccomp filter (both need `no_new_privs`, set first), closes
every other descriptor and execs the program. The parent stays outside, kills the child when the
host asks (or dies), and reports how it ended.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import resource
import select
import signal
import stat
import sys

# unshare(2) and mount(2) flags, prctl options (linux/sched.h, linux/mount.h, linux/prctl.h).
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2
# pivot_root has no libc wrapper; its number differs by architecture.
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
# Landlock (linux/landlock.h); the syscall numbers are the same on every architecture.
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LL_EXECUTE, LL_WRITE_FILE, LL_READ_FILE, LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
LL_TRUNCATE, LL_IOCTL_DEV = 1 << 14, 1 << 15
LL_FILE_RIGHTS = LL_EXECUTE | LL_WRITE_FILE | LL_READ_FILE | LL_TRUNCATE | LL_IOCTL_DEV
LL_READ = LL_READ_FILE | LL_READ_DIR

STATUS_EXIT, STATUS_SIGNAL, STATUS_SETUP_ERROR = "exit", "signal", "setup-error"


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
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
    def encode(s):
        return s.encode() if s is not None else None

    _check(libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)),
           f"mount {source} on {target}")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is missing or disabled."""
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                       ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(int(abi), 0)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _SockFprog(ctypes.Structure):  # struct sock_fprog (linux/filter.h)
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


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


def _seccomp(libc, program: bytes) -> None:
    """Loads a classic-BPF seccomp program (libseccomp's export) for this process and its
    descendants; `no_new_privs` must already be set."""
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0),
           "seccomp filter")


def _private_root(libc, config: dict) -> None:
    """Builds the run's root on a tmpfs at config["root"] and pivots into it (module docstring)."""
    root = config["root"]
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for path, target in config["links"]:
        os.makedirs(os.path.dirname(root + path), mode=0o755, exist_ok=True)
        os.symlink(target, root + path)
    for source, path, device in config["binds"]:
        inside = root + path
        os.makedirs(os.path.dirname(inside), mode=0o755, exist_ok=True)
        if os.path.isdir(source):
            os.makedirs(inside, mode=0o755, exist_ok=True)
        else:
            open(inside, "w").close()
        _mount(libc, source, inside, None, MS_BIND)
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | (0 if device else MS_NODEV)
        _mount(libc, None, inside, None, flags)
    work = root + config["work"]
    os.makedirs(work, mode=0o755)
    _mount(libc, "tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, config["tmpfs"])
    for name, text in config["files"].items():
        path = os.path.join(work, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        os.chown(path, config["uid"], config["uid"])
    number = SYS_PIVOT_ROOT[os.uname().machine]
    os.chdir(root)  # pivot_root(".", "."): the old root ends up stacked on "/", then detached
    _check(libc.syscall(ctypes.c_long(number), b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "detach the host's root")
    os.chdir("/")
    _mount(libc, None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _confine(libc, config: dict) -> None:
    """In the child (PID 1 of the new namespace, still root): confine, drop to the uid, exec."""
    for cgroup in config["cgroups"]:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write("0")
    uid = config["uid"]
    _private_root(libc, config)
    os.chdir(config["work"])
    for name, value in config["rlimits"].items():
        soft, hard = value if isinstance(value, list) else (value, value)
        resource.setrlimit(getattr(resource, name), (soft, hard))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    _landlock(libc, config["landlock_abi"], config["rules"])  # sets no_new_privs
    if config["seccomp"]:
        _seccomp(libc, base64.b64decode(config["seccomp"]))
    status_fd = config["status_fd"]
    os.set_inheritable(status_fd, False)
    os.closerange(3, status_fd)
    os.closerange(status_fd + 1, 65536)
    os.execve(config["argv"][0], config["argv"], config["env"])


def boot(config: dict) -> None:
    """The bootstrap: new namespaces, fork; the child confines itself and execs the program.

    The parent stays outside the new PID namespace, waits (killing the child when the host asks on
    the control pipe), and reports the child's end on the status pipe ("exit N" or "signal S");
    the child reports "setup-error ..." if confinement fails.
    """
    status_fd = config["status_fd"]
    libc = _libc()

    def report(line: str) -> None:
        os.write(status_fd, (line + "\n").encode())

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


if __name__ == "__main__":
    with open(sys.argv[1]) as config_file:
        boot(json.load(config_file))
