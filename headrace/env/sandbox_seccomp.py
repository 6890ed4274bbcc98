"""The sandbox's seccomp filter, built with libseccomp (`pyseccomp`), exported as classic BPF for
the bootstrap (`headrace.env.sandbox_boot`) to load just before it execs the program.

A deny list on top of the other layers (namespaces, private root, Landlock, unprivileged uid):
what an unprivileged program could still use to widen its reach or attack the kernel. Denied
calls fail with EPERM (the program sees `PermissionError`); `clone3`, whose flags seccomp cannot
read, fails with ENOSYS so that libc falls back to `clone`, whose namespace flags are denied.
`socket()`/`socketpair()` are denied for AF_UNIX, AF_NETLINK and AF_PACKET and for SOCK_RAW of any
family: seccomp cannot read a `connect` address, so the families go instead. A filter for another
architecture is refused by the kernel-side check libseccomp adds (the process is killed).
"""

from __future__ import annotations

import errno
import socket
import tempfile

# Namespaces, mounts and roots; tracing and other processes' memory; kernel keyrings, BPF, perf,
# userfaultfd and io_uring (large attack surface, not needed); modules, kexec, reboot, swap,
# accounting, quotas, raw I/O ports; file handles (open_by_handle_at escapes a chroot).
DENIED = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsmount",
    "fsconfig", "fspick", "move_mount", "open_tree", "mount_setattr",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "acct", "quotactl", "iopl", "ioperm", "syslog",
    "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "personality",
)
DENIED_FAMILIES = (socket.AF_UNIX, socket.AF_NETLINK, socket.AF_PACKET)
SOCK_TYPE_MASK = 0xF  # the type without SOCK_NONBLOCK / SOCK_CLOEXEC
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                   0x40000000)  # CLONE_NEW{NS,CGROUP,UTS,IPC,USER,PID,NET}


class SeccompUnavailable(RuntimeError):
    """libseccomp or its Python binding is missing; the message says what to install."""


def build_filter() -> bytes:
    """The filter as a classic-BPF program (what `prctl(PR_SET_SECCOMP)` loads).

    Raises:
      SeccompUnavailable: `pyseccomp` or the libseccomp shared library is missing.
    """
    try:
        import pyseccomp as sc
    except (ImportError, RuntimeError) as error:  # RuntimeError: no libseccomp.so
        raise SeccompUnavailable(
            f"seccomp filters need libseccomp and pyseccomp ({error}): `apt-get install "
            "libseccomp2` and `pip install pyseccomp`") from None
    deny = sc.ERRNO(errno.EPERM)
    rules = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in DENIED:
        try:
            rules.add_rule(deny, name)
        except (ValueError, RuntimeError, OSError):
            continue  # not a system call on this architecture
    rules.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in NAMESPACE_FLAGS:
        rules.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    for call in ("socket", "socketpair"):
        for family in DENIED_FAMILIES:
            rules.add_rule(deny, call, sc.Arg(0, sc.EQ, int(family)))
        rules.add_rule(deny, call, sc.Arg(1, sc.MASKED_EQ, SOCK_TYPE_MASK, socket.SOCK_RAW))
    with tempfile.TemporaryFile() as file:
        rules.export_bpf(file)
        file.seek(0)
        return file.read()
