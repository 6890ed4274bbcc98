"""The escape suite: a hostile program tries each way out of the sandbox, and each attempt is
stopped and reported; the test asserts by which mechanism (docs/environments.md has the table).

Needs root, Landlock and libseccomp (skips otherwise; HEADRACE_REQUIRE_SANDBOX=1 makes it fail).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import tempfile
import threading

import pytest

from headrace.env import sandbox as sb
from tests.env.test_sandbox import (
    SHORT_CPU_S,
    SHORT_WALL_S,
    TEST_UIDS,
    WALL_S,
    _require_sandbox,
    _sandbox_processes,
)

pytestmark = pytest.mark.timeout(90)

# Each attempt prints {name: "OK" | error name}; errno names are what the program saw.
PRELUDE = """
import ctypes, errno, json, os, socket
report = {}
libc = ctypes.CDLL(None, use_errno=True)
def attempt(name, action):
    try:
        result = action()
        report[name] = "OK" if result in (None, 0) or not isinstance(result, int) else (
            errno.errorcode.get(ctypes.get_errno(), str(result)) if result < 0 else "OK")
    except OSError as error:
        report[name] = errno.errorcode.get(error.errno, type(error).__name__)
"""
X86_64 = os.uname().machine == "x86_64"


@pytest.fixture(scope="module")
def mechanisms() -> sb.Mechanisms:
    return _require_sandbox()


@pytest.fixture(scope="module")
def box(mechanisms) -> sb.Sandbox:
    """For runs that end on their own: WALL_S leaves a loaded machine time to start Python."""
    return sb.Sandbox(sb.SandboxLimits(wall_s=WALL_S, cpu_s=2, memory_mb=256, max_procs=8,
                                       total_memory_mb=384, kill_output_bytes=1 << 20,
                                       output_bytes=4096), **TEST_UIDS)


@pytest.fixture(scope="module")
def short_box(box) -> sb.Sandbox:
    """For runs that only the deadline stops: `box`'s limits with SHORT_WALL_S, and RLIMIT_CPU
    above it so that the wall clock, not CPU time, is what stops them."""
    return sb.Sandbox(dataclasses.replace(box.limits, wall_s=SHORT_WALL_S, cpu_s=SHORT_CPU_S),
                      **TEST_UIDS)


def _report(box: sb.Sandbox, body: str) -> dict:
    result = box.run(["-c", PRELUDE + body + "\nprint(json.dumps(report))"])
    assert result.exit_code == 0, result.stderr.decode()[-2000:]
    return json.loads(result.stdout)


def test_fork_bomb_is_capped_by_the_pids_cgroup_and_killed_at_the_deadline(short_box):
    if short_box.mechanisms.pids_base is None:
        pytest.skip("no writable pids cgroup here (RLIMIT_NPROC stands in: test_sandbox.py)")
    result = short_box.run(["-c", "import os\nwhile True:\n    try:\n        os.fork()\n"
                                  "    except OSError:\n        pass"])
    assert result.timed_out and result.pids_limit_hit is True
    assert _sandbox_processes() == []


def test_memory_bomb_across_processes_meets_the_whole_sandbox_limit(box):
    """Four processes of 200 MB each stay under RLIMIT_AS (256 MB) but not under the run's
    384 MB: the memory cgroup's OOM killer ends them."""
    if box.mechanisms.memory_base is None:
        if os.environ.get("HEADRACE_REQUIRE_SANDBOX") == "1":
            pytest.fail("no writable memory cgroup, but the sandbox is required")
        pytest.skip("no writable memory cgroup here: only RLIMIT_AS limits memory")
    bomb = ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n"
            "        block = b'\\x01' * (200 << 20)\n        time.sleep(5)\n        os._exit(0)\n"
            "killed = 0\nfor _ in range(4):\n    killed += os.WIFSIGNALED(os.wait()[1])\n"
            "print('survived', 4 - killed)")
    result = box.run(["-c", bomb])
    # The wall limit (WALL_S) outlasts the children's 5 s: what ends them is the OOM killer, not
    # the deadline. Not all four survive (if the parent is the one killed, nothing is printed).
    assert result.memory_limit_hit is True and b"survived 4" not in result.stdout, result
    single = box.run(["-c", "b = b'\\x01' * (300 << 20)"])  # one process: RLIMIT_AS first
    assert single.exit_code == 1 and b"MemoryError" in single.stderr
    assert single.memory_limit_hit is False
    assert box.run(["-c", "print('alive')"]).stdout == b"alive\n"
    assert _sandbox_processes() == []


def test_infinite_loop_is_killed_at_the_deadline(short_box):
    result = short_box.run(["-c", "while True:\n    pass"])
    assert result.timed_out and result.signal == 9 and result.exit_code is None


def test_the_host_filesystem_is_not_there(box, tmp_path):
    run_folder = tmp_path / "run"
    run_folder.mkdir()
    (run_folder / "secrets.json").write_text('{"admin": "x"}')
    os.chmod(run_folder, 0o777)
    os.chmod(run_folder / "secrets.json", 0o666)
    report = _report(box, f"""
for path in ("/etc/shadow", "/etc/passwd", {str(run_folder / "secrets.json")!r}, "/root",
             {os.getcwd()!r}, "/tmp", "/var/run", "/run", "/sys/fs/cgroup", "/home"):
    attempt("read " + path, lambda: open(path).read() if os.path.isfile(path) else os.listdir(path))
for path in ("/tmp/evil", "/evil", "/py/evil", "/usr/lib/evil", {str(run_folder / "evil")!r}):
    attempt("write " + path, lambda: open(path, "w").write("x"))
attempt("write inside", lambda: open("inside.txt", "w").write("x"))
attempt("listdir /", lambda: os.listdir("/"))
""")
    assert report.pop("write inside") == "OK"
    for name, outcome in report.items():
        if name.startswith("read ") or name == "listdir /":
            # absent from the private root; what exists there (/, /usr/lib) Landlock refuses
            assert outcome in ("ENOENT", "EACCES"), (name, outcome)
        else:
            assert outcome in ("ENOENT", "EROFS", "EACCES"), (name, outcome)
    for host_path in ("/etc/shadow", "/etc/passwd", str(run_folder / "secrets.json")):
        assert report[f"read {host_path}"] == "ENOENT"  # not merely refused: not there at all
    assert not (run_folder / "evil").exists() and not os.path.exists("/evil")


def test_network_is_unreachable_and_unix_sockets_are_refused(box):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    unix_dir = tempfile.mkdtemp(prefix="headrace-test-")
    os.chmod(unix_dir, 0o777)
    unix_path = os.path.join(unix_dir, "host.sock")
    unix_server = socket.socket(socket.AF_UNIX)
    unix_server.bind(unix_path)
    os.chmod(unix_path, 0o777)
    unix_server.listen()
    unix_server.settimeout(0.2)
    try:
        report = _report(box, f"""
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=0.5))
attempt("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("1.1.1.1", 53)))
attempt("unix socket()", lambda: socket.socket(socket.AF_UNIX))
attempt("unix socketpair()", lambda: socket.socketpair())
attempt("netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))
attempt("packet", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0))
attempt("raw", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
""")
        for listener in (server, unix_server):
            with pytest.raises(TimeoutError):
                listener.accept()
    finally:
        server.close()
        unix_server.close()
        os.unlink(unix_path)
        os.rmdir(unix_dir)
    assert report["tcp"] in ("ENETUNREACH", "EACCES") and report["udp"] == "ENETUNREACH", report
    for name in ("unix socket()", "unix socketpair()", "netlink", "packet", "raw"):
        assert report[name] == "EPERM", (name, report)  # seccomp


def test_without_seccomp_the_private_root_still_hides_host_sockets(mechanisms, box):
    """Layer by layer: with the filter off, socket(AF_UNIX) works but no host path exists."""
    bare = sb.Sandbox(box.limits, _mechanisms=sb.Mechanisms(
        mechanisms.landlock_abi, mechanisms.pids, mechanisms.pids_base, mechanisms.memory,
        mechanisms.memory_base, seccomp=False), **TEST_UIDS)
    report = _report(bare, """
attempt("unix socket()", lambda: socket.socket(socket.AF_UNIX).close())
attempt("connect host socket", lambda: socket.socket(socket.AF_UNIX).connect("/run/redis.sock"))
attempt("unshare user", lambda: libc.unshare(0x10000000))
""")
    assert report["unix socket()"] == "OK" and report["connect host socket"] == "ENOENT", report
    # Where the kernel lets unprivileged users make user namespaces ("OK"), only seccomp stops it.
    assert report["unshare user"] in ("OK", "EPERM", "ENOSPC", "EINVAL"), report


def test_namespaces_ptrace_mounts_and_kernel_interfaces_are_denied(box):
    syscalls = "" if not X86_64 else """
for name, number in (("bpf", 321), ("keyctl", 250), ("userfaultfd", 323), ("io_uring_setup", 425),
                     ("perf_event_open", 298), ("init_module", 175), ("setns", 308)):
    attempt(name, lambda: libc.syscall(number, 0, 0, 0, 0, 0))
"""
    report = _report(box, """
CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET = 0x10000000, 0x00020000, 0x40000000
attempt("unshare user", lambda: libc.unshare(CLONE_NEWUSER))
attempt("unshare mount+net", lambda: libc.unshare(CLONE_NEWNS | CLONE_NEWNET))
attempt("ptrace parent", lambda: libc.ptrace(16, os.getppid(), 0, 0))  # PTRACE_ATTACH
pid = os.fork()
if pid == 0:
    os.pause()
attempt("ptrace child", lambda: libc.ptrace(16, pid, 0, 0))
os.kill(pid, 9)
os.waitpid(pid, 0)
attempt("mount proc", lambda: libc.mount(b"proc", b"/work", b"proc", 0, None))
attempt("chroot", lambda: libc.chroot(b"/work"))
attempt("setuid root", lambda: os.setuid(0))
""" + syscalls)
    assert report and all(outcome == "EPERM" for outcome in report.values()), report


def test_proc_tricks_find_no_proc(box):
    report = _report(box, """
for path in ("/proc/self/mem", "/proc/1/root", "/proc/self/environ", "/proc/sysrq-trigger",
             "/proc/1/cwd", "/sys/kernel", "/dev/mem", "/dev/kmsg"):
    attempt(path, lambda: open(path, "rb").read(1) if not path.endswith(("root", "cwd"))
            else os.listdir(path))
""")
    assert set(report.values()) == {"ENOENT"}, report


def test_huge_output_is_capped_and_killed(box):
    result = box.run(["-c", "import os\nwhile True:\n    os.write(1, b'x' * 65536)"])
    assert result.output_limited and result.output_truncated
    assert len(result.stdout) == 4096 and result.stdout_total > 1 << 20


def test_an_escape_attempt_in_one_run_does_not_affect_a_concurrent_one(box, short_box):
    outputs: list[bytes] = []
    fork_bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    bomb = threading.Thread(target=lambda: short_box.run(["-c", fork_bomb]))
    bomb.start()
    try:
        for _ in range(3):
            outputs.append(box.run(["-c", "print(6 * 7)"]).stdout)
    finally:
        bomb.join(SHORT_WALL_S + 20)  # the deadline, then the kill and sweep
    assert outputs == [b"42\n"] * 3
    assert _sandbox_processes() == []
