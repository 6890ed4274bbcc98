"""python_exec: write a small Python function; hidden test cases decide the reward.

Each seed picks a task (`TASKS[seed % len(TASKS)]`, e.g. "def add(a, b)") and draws its test inputs.
The action is Python source (a Markdown code fence around it is accepted). The program runs in a
`headrace.env.sandbox.Sandbox`; a fixed harness, passed on the interpreter's command line, reads the
test inputs from stdin, executes the program as a module named `submission` (so an `if __name__ ==
"__main__"` block does not run), calls the function on every input and writes the return values as
one JSON line on a private copy of stdout (the program's own prints go to stderr). The expected
outputs never leave the grader process: they are computed here from the reference solution and
compared, as canonical JSON (so `1` is not `True`), with what the harness reported. A program that
prints "PASS", exits early, forges an extra result line or searches the disk for the tests gains
nothing: without exactly one well-formed result with every value right, the reward is 0.

Reward: 1.0 when every case passes (or the passed fraction with `partial_credit=True`), else 0.
After a failed attempt the observation says how many cases passed and the first error's type (never
the hidden inputs or outputs); the episode continues until success or `max_turns` attempts (then
truncated). An empty action, one over `max_code_bytes` or one with a NUL byte is an invalid action.

Info keys of every graded step: success, passed, total, timeout, exit_code, signal, load_error,
no_result, grader_tampered, memory_error, output_truncated, pids_limit_hit, memory_limit_hit
(the whole sandbox reached its memory cgroup's limit; None where the host has no memory cgroup),
sandbox_s.

Failure modes: a host without the sandbox's mechanisms makes the constructor raise
`SandboxUnavailable` (never run unconfined); a failure of the sandbox machinery raises
`SandboxError` from `step` (the actor counts it as an env error); anything the program does is
reported in info and scored, never raised.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Callable
from typing import Any

from headrace.env.base import Env, EnvError, EnvSpec, StepResult
from headrace.env.sandbox import Sandbox, SandboxLimits

RESULT_MARKER = "@@HEADRACE-RESULT@@ "

# Runs inside the sandbox. It holds no expected output: only inputs arrive (on stdin).
HARNESS = r"""
import json, os, sys
request = json.loads(sys.stdin.read())
channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
os.dup2(2, 1)
def report(payload):
    channel.write("\n" + request["marker"] + json.dumps(payload) + "\n")
    channel.flush()
namespace = {"__name__": "submission"}
try:
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    exec(compile(source, "main.py", "exec"), namespace)
    function = namespace.get(request["function"])
    if not callable(function):
        raise NameError(f"function {request['function']}() is not defined")
except BaseException as error:
    report({"load_error": f"{type(error).__name__}: {error}"[:300]})
    sys.exit(0)
results = []
for args in request["cases"]:
    try:
        value = function(*args)
        json.dumps(value)
        results.append({"value": value})
    except BaseException as error:
        results.append({"error": type(error).__name__})
report({"results": results})
"""


@dataclasses.dataclass(frozen=True)
class Task:
    """One function-writing problem: what to write, a reference solution, an input generator."""

    function: str  # the function's name
    signature: str  # e.g. "add(a, b)"
    description: str  # what it must return
    reference: str  # source of a correct solution (also the `solve` demonstration)
    inputs: Callable[[random.Random], list]  # draws the positional arguments of one case
    example: tuple = ()  # arguments of the example shown in the prompt


def _ints(rng: random.Random, lo: int = -50, hi: int = 50, n: tuple[int, int] = (1, 8)) -> list:
    return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


def _word(rng: random.Random, alphabet: str = "abcdeio", n: tuple[int, int] = (0, 9)) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(*n)))


def _palindrome(rng: random.Random) -> str:
    half = _word(rng, "abc", (0, 4))
    return half + rng.choice(["", "x"]) + half[::-1] if rng.random() < 0.5 else _word(rng, "ab")


TASKS: tuple[Task, ...] = (
    Task("add", "add(a, b)", "returns the sum of the integers a and b",
         "def add(a, b):\n    return a + b\n",
         lambda r: [r.randint(-999, 999), r.randint(-999, 999)], (2, 3)),
    Task("reverse_string", "reverse_string(s)", "returns the string s reversed",
         "def reverse_string(s):\n    return s[::-1]\n", lambda r: [_word(r)], ("abc",)),
    Task("max_of_list", "max_of_list(xs)", "returns the largest integer of the non-empty list xs",
         "def max_of_list(xs):\n    return max(xs)\n", lambda r: [_ints(r)], ([3, 9, 2],)),
    Task("is_palindrome", "is_palindrome(s)",
         "returns True if the string s reads the same backwards, else False",
         "def is_palindrome(s):\n    return s == s[::-1]\n", lambda r: [_palindrome(r)],
         ("aba",)),
    Task("factorial", "factorial(n)", "returns n! for an integer 0 <= n <= 12",
         "def factorial(n):\n    result = 1\n    for k in range(2, n + 1):\n        result *= k\n"
         "    return result\n", lambda r: [r.randint(0, 12)], (4,)),
    Task("fibonacci", "fibonacci(n)",
         "returns the n-th Fibonacci number, with fibonacci(0) == 0 and fibonacci(1) == 1",
         "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
         "    return a\n", lambda r: [r.randint(0, 30)], (7,)),
    Task("count_vowels", "count_vowels(s)",
         "returns how many of the characters of s are in 'aeiou'",
         "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n",
         lambda r: [_word(r, "abeioxu")], ("banana",)),
    Task("sum_of_evens", "sum_of_evens(xs)", "returns the sum of the even integers of the list xs",
         "def sum_of_evens(xs):\n    return sum(x for x in xs if x % 2 == 0)\n",
         lambda r: [_ints(r, n=(0, 8))], ([1, 2, 3, 4],)),
    Task("fizzbuzz", "fizzbuzz(n)",
         "returns 'FizzBuzz' if n is divisible by 15, 'Fizz' if by 3, 'Buzz' if by 5, else str(n)",
         "def fizzbuzz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n    if n % 3 == 0:\n"
         "        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n    return str(n)\n",
         lambda r: [r.randint(1, 100)], (9,)),
    Task("gcd", "gcd(a, b)", "returns the greatest common divisor of the positive integers a and b",
         "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
         lambda r: [r.randint(1, 500), r.randint(1, 500)], (12, 18)),
    Task("is_prime", "is_prime(n)", "returns True if the integer n is a prime number, else False",
         "def is_prime(n):\n    if n < 2:\n        return False\n    k = 2\n    while k * k <= n:\n"
         "        if n % k == 0:\n            return False\n        k += 1\n    return True\n",
         lambda r: [r.randint(-3, 200)], (7,)),
    Task("word_count", "word_count(s)", "returns the number of whitespace-separated words in s",
         "def word_count(s):\n    return len(s.split())\n",
         lambda r: [" ".join(_word(r, "ab", (1, 3)) for _ in range(r.randint(0, 5)))],
         ("to be or",)),
)
_REFERENCES: dict[str, Callable] = {}
for _task in TASKS:
    _namespace: dict[str, Any] = {}
    exec(compile(_task.reference, f"<reference {_task.function}>", "exec"), _namespace)  # trusted
    _REFERENCES[_task.function] = _namespace[_task.function]

_FENCE = re.compile(r"```[A-Za-z0-9_+-]*[ \t]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(action: str) -> str:
    """The program in `action`: the first Markdown code fence's body, else the whole text."""
    match = _FENCE.search(action)
    return match.group(1) if match else action


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


class PythonExec(Env):
    """Function-writing tasks graded in the sandbox (see the module docstring).

    Args:
      max_turns: attempts per episode.
      cases: hidden test cases per task.
      partial_credit: reward the passed fraction instead of all-or-nothing.
      tasks: names of the tasks to draw from (default: all of `TASKS`).
      wall_s, memory_mb, max_procs: sandbox limits of one grading run (the whole run's memory
        is max(768, memory_mb + 256) MB).
      max_code_bytes: longer programs are invalid actions.

    Raises:
      EnvError: bad arguments. SandboxUnavailable: this host cannot confine the program.
    """

    def __init__(self, max_turns: int = 1, cases: int = 8, partial_credit: bool = False,
                 tasks: list[str] | None = None, wall_s: float = 5.0, memory_mb: int = 512,
                 max_procs: int = 16, max_code_bytes: int = 16384):
        if max_turns < 1 or cases < 1 or max_code_bytes < 1:
            raise EnvError(f"python_exec: max_turns={max_turns}, cases={cases} and "
                           f"max_code_bytes={max_code_bytes} must be >= 1")
        known = {t.function: t for t in TASKS}
        unknown = sorted(set(tasks or ()) - set(known))
        if unknown:
            raise EnvError(f"python_exec: unknown tasks {unknown}; choose from {sorted(known)}")
        self.tasks = tuple(known[name] for name in tasks) if tasks else TASKS
        self.max_turns, self.n_cases, self.partial_credit = max_turns, cases, partial_credit
        self.max_code_bytes = max_code_bytes
        self.spec = EnvSpec(vocabulary=None, action_words=None, max_turns=max_turns)
        try:
            limits = SandboxLimits(wall_s=wall_s, cpu_s=max(1, int(wall_s + 0.999)),
                                   memory_mb=memory_mb, max_procs=max_procs,
                                   # the whole run: one process's address space plus room
                                   total_memory_mb=max(768, memory_mb + 256))
        except ValueError as error:
            raise EnvError(f"python_exec: {error}") from None
        self.sandbox = Sandbox(limits)
        self._task = self.tasks[0]
        self._cases: list[list] = []
        self._expected: list[str] = []
        self._turns = 0

    def task_for(self, seed: int) -> Task:
        return self.tasks[seed % len(self.tasks)]

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self._task = self.task_for(seed)
        rng = random.Random(seed)
        self._cases = [json.loads(json.dumps(self._task.inputs(rng))) for _ in range(self.n_cases)]
        reference = _REFERENCES[self._task.function]
        self._expected = [_canonical(reference(*args)) for args in self._cases]
        self._turns = 0
        task = self._task
        example = f"{task.function}({', '.join(map(repr, task.example))})"
        prompt = (f"Write a Python function {task.signature} that {task.description}. "
                  f"Example: {example} == {reference(*task.example)!r}")
        return prompt, {"task": task.function}

    def solve(self, seed: int) -> list[str]:
        """A correct demonstration: the reference solution of the seed's task."""
        return [self.task_for(seed).reference]

    def step(self, action: str) -> StepResult:
        self._turns += 1
        code = extract_code(action)
        if not code.strip() or "\x00" in code or len(code.encode()) > self.max_code_bytes:
            return "", 0.0, True, False, {"invalid_action": True, "success": False}
        observation, passed, info = self.grade(code)
        success = passed == len(self._cases)
        if success:
            reward = 1.0
        else:
            reward = passed / len(self._cases) if self.partial_credit else 0.0
        truncated = not success and self._turns >= self.max_turns
        return observation, reward, success, truncated, info

    def grade(self, code: str) -> tuple[str, int, dict[str, Any]]:
        """Runs `code` on the hidden cases: (observation, cases passed, info)."""
        request = {"function": self._task.function, "cases": self._cases,
                   "marker": RESULT_MARKER}
        result = self.sandbox.run(["-c", HARNESS], files={"main.py": code},
                                  stdin=json.dumps(request).encode())
        total = len(self._cases)
        info: dict[str, Any] = {
            "success": False, "passed": 0, "total": total, "timeout": result.timed_out,
            "exit_code": result.exit_code, "signal": result.signal, "load_error": None,
            "no_result": False, "grader_tampered": False, "memory_error": False,
            "output_truncated": result.output_truncated, "pids_limit_hit": result.pids_limit_hit,
            "memory_limit_hit": result.memory_limit_hit, "sandbox_s": round(result.wall_s, 4),
        }
        stderr = result.stderr.decode(errors="replace")
        info["memory_error"] = "MemoryError" in stderr or bool(result.memory_limit_hit)
        lines = [line for line in result.stdout.decode(errors="replace").split("\n")
                 if line.startswith(RESULT_MARKER)]
        if result.timed_out:
            return f"error: time limit of {self.sandbox.limits.wall_s:g} s exceeded", 0, info
        if len(lines) > 1:
            info["grader_tampered"] = True
            return "error: more than one result line: the grader output was tampered with", 0, info
        try:
            payload = json.loads(lines[0][len(RESULT_MARKER):]) if lines else None
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            info["no_result"] = True
            tail = stderr.strip().splitlines()[-1:] or [f"exit code {result.exit_code}"]
            return f"error: the program ended before the tests ran ({tail[0][:200]})", 0, info
        if "load_error" in payload:
            info["load_error"] = str(payload["load_error"])[:300]
            return f"error: {info['load_error']}", 0, info
        results = payload.get("results")
        if not isinstance(results, list) or len(results) != total:
            info["grader_tampered"] = True
            return "error: malformed result: the grader output was tampered with", 0, info
        passed = 0
        first_error = None
        for got, expected in zip(results, self._expected, strict=True):
            if isinstance(got, dict) and "value" in got and _canonical(got["value"]) == expected:
                passed += 1
            elif first_error is None and isinstance(got, dict) and "error" in got:
                first_error = str(got["error"])[:80]
        info["memory_error"] = info["memory_error"] or first_error == "MemoryError"
        info["passed"], info["success"] = passed, passed == total
        observation = f"passed {passed}/{total} tests"
        if first_error:
            observation += f"; first error: {first_error}"
        return observation, passed, info
