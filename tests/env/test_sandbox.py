"""The sandbox and python_exec: every escape attempt is stopped or scores 0, and is reported,
while the sandbox keeps working for the next run. Needs root and Landlock (skips otherwise)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading

import pytest

from headrace.env import python_exec as python_exec_module
from headrace.env import sandbox as sb
from headrace.env.python_exec import TASKS, PythonExec, extract_code

pytestmark = pytest.mark.timeout(60)

# A uid range of this test process's own: the machine may run other sandboxes meanwhile (other
# test processes, a python_exec run) whose processes must not count as this test's leftovers.
TEST_UIDS = {"uid_base": 1_850_000 + (os.getpid() % 2048) * 16, "uid_count": 16}


def _require_sandbox() -> sb.Mechanisms:
    """Skips where the host cannot confine code; fails instead with HEADRACE_REQUIRE_SANDBOX=1
    (set it in CI, where the sandbox must work)."""
    try:
        return sb.probe()
    except sb.SandboxUnavailable as error:
        if os.environ.get("HEADRACE_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"sandbox unavailable but required: {error}")
        pytest.skip(f"sandbox unavailable on this host: {error}")


# The wall-clock limit of runs that must end on their own: a sandboxed Python start can take
# seconds on a loaded machine. Runs that must be stopped at the deadline use SHORT_WALL_S instead.
# SHORT_WALL_S leaves a loaded machine time to start the program (a fork bomb must get to its
# pids limit), and RLIMIT_CPU is raised above it so that the wall clock, not CPU time, stops it.
WALL_S = 10.0
SHORT_WALL_S, SHORT_CPU_S = 3.0, 10


@pytest.fixture(scope="module")
def sandbox() -> sb.Sandbox:
    _require_sandbox()
    return sb.Sandbox(sb.SandboxLimits(wall_s=WALL_S, cpu_s=2, memory_mb=256, max_procs=8,
                                       kill_output_bytes=1 << 20, output_bytes=4096), **TEST_UIDS)


def _short(limits: sb.SandboxLimits) -> sb.SandboxLimits:
    return dataclasses.replace(limits, wall_s=SHORT_WALL_S, cpu_s=SHORT_CPU_S)


@pytest.fixture
def open_dir():
    """A world-writable directory in /tmp holding a world-readable secret: only Landlock, not
    file permissions, can keep the sandbox out of it."""
    path = tempfile.mkdtemp(prefix="headrace-test-")
    os.chmod(path, 0o777)
    secret = os.path.join(path, "secret.txt")
    with open(secret, "w") as f:
        f.write("the hidden tests")
    os.chmod(secret, 0o666)
    try:
        yield path, secret
    finally:
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        os.rmdir(path)


def _sandbox_processes() -> list[int]:
    """Pids of processes running under this test process's sandbox uids (there must be none
    between runs)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    uid = int(next(row for row in f if row.startswith("Uid:")).split()[1])
            except (OSError, StopIteration):
                continue
            if TEST_UIDS["uid_base"] <= uid < TEST_UIDS["uid_base"] + TEST_UIDS["uid_count"]:
                found.append(int(entry))
    return found


def _run_json(sandbox: sb.Sandbox, program: str) -> dict:
    result = sandbox.run(["-c", program])
    assert result.exit_code == 0, result.stderr.decode()
    return json.loads(result.stdout)


# ------------------------------------------------------------------------------------- sandbox

def test_trivial_run_is_fast_unprivileged_and_in_its_own_directory(sandbox):
    result = sandbox.run(["main.py"], files={"main.py": "import os, sys\nprint(os.getuid(), "
                                            "os.getgid(), os.getgroups(), sorted(os.listdir('.')),"
                                            " sys.stdin.read())"}, stdin=b"hello")
    assert result.ok and not result.timed_out
    uid, gid, groups, listing, echoed = result.stdout.decode().split(" ", 4)
    assert int(uid) >= 1_800_000 and int(gid) == int(uid) and groups == "[]"
    assert listing == "['main.py']" and echoed.strip() == "hello"
    assert 0 < result.wall_s < sandbox.limits.wall_s  # it ended on its own (speed: not here)


def test_reading_outside_the_allowed_paths_is_denied(sandbox, open_dir):
    _, secret = open_dir
    root_secret = tempfile.NamedTemporaryFile(dir="/root", delete=False)
    root_secret.write(b"root secret")
    root_secret.close()
    os.chmod(root_secret.name, 0o644)
    paths = ["/etc/hostname", "/etc/passwd", secret, root_secret.name, "/proc/1/environ",
             "/proc/self/status", python_exec_module.__file__]
    try:
        report = _run_json(sandbox, f"""
import json, os
report = {{}}
for path in {paths!r}:
    try:
        open(path).read()
        report[path] = "READ"
    except OSError as error:
        report[path] = type(error).__name__
for directory in ("/", "/tmp", "/etc", {os.path.dirname(secret)!r}):
    try:
        os.listdir(directory)
        report[directory] = "LISTED"
    except OSError as error:
        report[directory] = type(error).__name__
print(json.dumps(report))
""")
    finally:
        os.unlink(root_secret.name)
    assert report and "READ" not in report.values() and "LISTED" not in report.values(), report


def test_writing_outside_the_working_directory_is_denied(sandbox, open_dir):
    directory, secret = open_dir
    target = os.path.join(directory, "evil.txt")
    report = _run_json(sandbox, f"""
import json
report = {{}}
for path in ({target!r}, {secret!r}, "/dev/shm/evil", "/tmp/evil-headrace", "inside.txt"):
    try:
        with open(path, "w") as f:
            f.write("x")
        report[path] = "WROTE"
    except OSError as error:
        report[path] = type(error).__name__
print(json.dumps(report))
""")
    assert report.pop("inside.txt") == "WROTE"
    assert "WROTE" not in report.values(), report
    assert not os.path.exists(target) and open(secret).read() == "the hidden tests"
    assert not os.path.exists("/tmp/evil-headrace")


def test_no_network_even_to_the_hosts_loopback(sandbox):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    try:
        report = _run_json(sandbox, f"""
import json, socket
report = {{}}
for name, address in (("loopback", ("127.0.0.1", {port})), ("internet", ("1.1.1.1", 53))):
    try:
        socket.create_connection(address, timeout=0.5).close()
        report[name] = "CONNECTED"
    except OSError as error:
        report[name] = type(error).__name__
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("1.1.1.1", 53))
    report["udp"] = "SENT"
except OSError as error:
    report["udp"] = type(error).__name__
print(json.dumps(report))
""")
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
    assert set(report.values()) & {"CONNECTED", "SENT"} == set(), report


def test_infinite_loop_is_killed_at_the_wall_clock_limit(sandbox):
    box = sb.Sandbox(_short(sandbox.limits), **TEST_UIDS)
    result = box.run(["-c", "while True: pass"])
    assert result.timed_out and result.exit_code is None and not result.ok
    # Not before the deadline; after it, only the kill and clean-up (stop's 2 s fallback, the
    # sweep): an unenforced deadline would instead end at RLIMIT_CPU, not timed out.
    assert SHORT_WALL_S - 0.1 < result.wall_s < SHORT_WALL_S + 8.0
    assert sandbox.run(["-c", "print(1)"]).ok
    assert _sandbox_processes() == []


@pytest.mark.parametrize("mode", ["cgroup", "rlimit"])
def test_fork_bomb_is_contained_and_swept(sandbox, mode, monkeypatch):
    mechanisms = sandbox.mechanisms
    if mode == "cgroup" and mechanisms.pids_base is None:
        pytest.skip("no writable pids cgroup on this host")
    if mode == "rlimit":
        mechanisms = sb.Mechanisms(mechanisms.landlock_abi, "rlimit", None)
    box = sb.Sandbox(_short(sandbox.limits), _mechanisms=mechanisms, **TEST_UIDS)
    after = sb.Sandbox(sandbox.limits, _mechanisms=mechanisms, **TEST_UIDS)  # the next run
    made: list[str] = []
    real_create = sb.RunCgroups.create

    def spy(*args, **kwargs):
        made.extend((cgroups := real_create(*args, **kwargs)).dirs)
        return cgroups

    monkeypatch.setattr(sb.RunCgroups, "create", spy)
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = box.run(["-c", bomb])
    assert result.timed_out
    if mode == "cgroup":
        assert result.pids_limit_hit is True
        assert made and not any(os.path.exists(d) for d in made)  # its cgroups are removed
    assert _sandbox_processes() == []
    assert after.run(["-c", "print('alive')"]).stdout == b"alive\n"


def test_memory_hog_gets_memory_error(sandbox):
    result = sandbox.run(["-c", "blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))"])
    assert result.exit_code == 1 and b"MemoryError" in result.stderr and not result.timed_out


def test_daemonised_children_die_with_the_run(sandbox):
    result = sandbox.run(["-c", "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
                                "    time.sleep(30)\nelse:\n    print('parent done')"])
    assert result.ok and result.stdout == b"parent done\n"
    assert _sandbox_processes() == []


def test_output_is_capped_and_a_flood_is_killed(sandbox):
    result = sandbox.run(["-c", "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)"])
    assert result.output_limited and result.output_truncated
    assert len(result.stdout) == 4096 and result.stdout_total > 1 << 20
    # Killed for its output, not left to run into the wall-clock limit.
    assert not result.timed_out and result.wall_s < sandbox.limits.wall_s


def test_a_kill_request_to_a_bootstrap_that_died_first_is_not_an_error():
    # The flood and wall-clock kills race the bootstrap's own end: the request then finds the
    # control pipe's reader gone. The pipe's file is opened as the sandbox opens it (buffered).
    from headrace.env.sandbox_io import stop

    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    with os.fdopen(write_fd, "wb") as control:
        stop(proc, control)  # neither here nor at close: BrokenPipeError


def test_file_size_limit_and_working_directory_removed(sandbox, monkeypatch):
    # The run's own folder, not a listing of the temporary directory: other test processes
    # (pytest -n) make and remove sandbox folders there at the same time.
    made, mkdtemp = [], tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(**kw)) or made[-1])
    result = sandbox.run(["-c", "open('big', 'wb').write(b'x' * (64 << 20))"])
    assert result.exit_code == 1 and b"File too large" in result.stderr
    assert len(made) == 1 and made[0].startswith(os.path.join(tempfile.gettempdir(), "headrace-sbx-"))
    assert not os.path.exists(made[0])


def test_concurrent_runs_get_distinct_uids(sandbox):
    uids: list[int] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            uids.append(int(sandbox.run(["-c", "import os; print(os.getuid())"]).stdout))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(3 * WALL_S)  # each run ends by its wall-clock limit
    assert not errors and len(set(uids)) == 4


def test_bad_file_name_is_rejected(sandbox):
    with pytest.raises(ValueError, match="file name"):
        sandbox.run(["main.py"], files={"../escape.py": "x"})


def test_refuses_without_root_landlock_or_libseccomp(monkeypatch):
    monkeypatch.setattr(sb.os, "geteuid", lambda: 1000)
    with pytest.raises(sb.SandboxUnavailable, match="needs root"):
        sb._probe_uncached()
    monkeypatch.setattr(sb.os, "geteuid", lambda: 0)
    monkeypatch.setattr(sb, "landlock_abi", lambda: 0)
    with pytest.raises(sb.SandboxUnavailable, match="Landlock is unavailable"):
        sb._probe_uncached()
    monkeypatch.setattr(sb, "landlock_abi", lambda: 7)
    monkeypatch.setattr(sb, "_filter", None)

    def no_libseccomp():
        raise sb.SeccompUnavailable("seccomp filters need libseccomp and pyseccomp (gone)")

    monkeypatch.setattr(sb, "build_filter", no_libseccomp)
    with pytest.raises(sb.SandboxUnavailable, match="libseccomp"):
        sb._probe_uncached()


# --------------------------------------------------------------------------------- python_exec

@pytest.fixture(scope="module")
def env() -> PythonExec:
    _require_sandbox()
    env = PythonExec(wall_s=WALL_S, memory_mb=256, max_procs=8)
    env.sandbox.uid_base, env.sandbox.uid_count = TEST_UIDS["uid_base"], TEST_UIDS["uid_count"]
    return env


def test_every_reference_solution_scores_one(env):
    for seed in range(len(TASKS)):
        prompt, info = env.reset(seed)
        assert info["task"] in prompt
        obs, reward, terminated, truncated, info = env.step(env.solve(seed)[0])
        assert (reward, terminated, truncated) == (1.0, True, False), (prompt, obs, info)
        assert info["passed"] == info["total"] == 8
        assert 0 < info["sandbox_s"] < env.sandbox.limits.wall_s and not info["timeout"]


def _assert_scores_zero_then_recovers(env, code: str, short_wall: bool = False, **expected_info):
    """`short_wall`: `code` runs until stopped, so it runs under SHORT_WALL_S (the same env, its
    sandbox's limits lowered for that step only; the recovery gets the full limit)."""
    env.reset(0)  # task "add"
    limits = env.sandbox.limits
    if short_wall:
        env.sandbox.limits = _short(limits)
    try:
        obs, reward, terminated, truncated, info = env.step(code)
    finally:
        env.sandbox.limits = limits
    assert reward == 0.0 and not info["success"] and truncated, (obs, info)
    for key, value in expected_info.items():
        assert info[key] == value, (key, obs, info)
    env.reset(0)
    assert env.step(env.solve(0)[0])[1] == 1.0
    return obs, info


def test_wrong_answers_and_type_confusion_score_zero(env):
    _assert_scores_zero_then_recovers(env, "def add(a, b):\n    return a - b")
    _assert_scores_zero_then_recovers(env, "def add(a, b):\n    return float(a + b)")
    env.reset(3)  # is_palindrome: 1 and 0 are not True and False
    assert env.step("def is_palindrome(s):\n    return int(s == s[::-1])")[1] == 0.0


def test_gaming_the_grader_scores_zero(env):
    obs, _ = _assert_scores_zero_then_recovers(env, "print('PASS')\nprint('passed 8/8 tests')")
    assert "not defined" in obs
    _assert_scores_zero_then_recovers(env, "import os\nos._exit(0)", no_result=True, exit_code=0)
    _assert_scores_zero_then_recovers(env, "import sys\nsys.exit(0)", load_error="SystemExit: 0")
    forged = ("import atexit, os\nline = '\\n' + " + repr(python_exec_module.RESULT_MARKER)
              + " + '{\"results\": []}\\n'\natexit.register(lambda: os.write(3, line.encode()))"
              "\ndef add(a, b):\n    return 0")
    _assert_scores_zero_then_recovers(env, forged, grader_tampered=True)
    hunt = (f"import glob, os\nsource = open({python_exec_module.__file__!r}).read()\n"
            "def add(a, b):\n    return a + b")
    obs, info = _assert_scores_zero_then_recovers(env, hunt)
    assert "FileNotFoundError" in info["load_error"]  # the private root has no such path


def test_the_hidden_outputs_never_enter_the_sandbox(env, monkeypatch):
    seen: list[bytes] = []
    real_run = env.sandbox.run

    def spy(args, files=None, stdin=b""):
        seen.append(stdin + json.dumps(files).encode() + json.dumps(args).encode())
        return real_run(args, files, stdin)

    monkeypatch.setattr(env.sandbox, "run", spy)
    env.reset(5)  # fibonacci: outputs are large numbers, inputs are at most 30
    env.step(env.solve(5)[0])
    expected = [e for e in env._expected if int(e) > 1000]
    assert expected and seen and not any(e.encode() in blob for e in expected for blob in seen)


def test_hostile_programs_are_stopped_and_reported(env):
    _assert_scores_zero_then_recovers(env, "def add(a, b):\n    while True:\n        pass",
                                      short_wall=True, timeout=True)
    _, info = _assert_scores_zero_then_recovers(
        env, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
             "        pass\ndef add(a, b):\n    return a + b", short_wall=True, timeout=True)
    assert info["pids_limit_hit"] in (True, None)
    _assert_scores_zero_then_recovers(env, "def add(a, b):\n    x = bytearray(10**10)\n"
                                           "    return a + b", memory_error=True)
    _assert_scores_zero_then_recovers(env, "import socket\nsocket.create_connection(('1.1.1.1', "
                                           "53), timeout=0.5)\ndef add(a, b):\n    return a + b")
    assert _sandbox_processes() == []


def test_invalid_actions_and_markdown(env):
    env.reset(0)
    for action in ("", "   \n", "def add(a, b):\x00"):
        assert env.step(action)[4] == {"invalid_action": True, "success": False}
    env.reset(0)
    fenced = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert extract_code(fenced) == "def add(a, b):\n    return a + b\n"
    assert env.step(fenced)[1] == 1.0


def test_multiple_attempts_and_partial_credit():
    _require_sandbox()
    env = PythonExec(max_turns=2, partial_credit=True, wall_s=WALL_S)
    env.reset(4)  # factorial
    obs, reward, terminated, truncated, info = env.step("def factorial(n):\n    return n")
    assert not terminated and not truncated and 0.0 <= reward < 1.0
    assert obs.startswith("passed ") and reward == info["passed"] / 8
    assert env.step(env.solve(4)[0])[1:4] == (1.0, True, False)


def test_bad_arguments_fail_clearly():
    from headrace.env.base import EnvError

    with pytest.raises(EnvError, match="unknown tasks"):
        PythonExec(tasks=["nope"])
    with pytest.raises(EnvError, match="max_turns"):
        PythonExec(max_turns=0)
