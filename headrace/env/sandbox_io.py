"""The sandbox host's side of the bootstrap's pipes: feeding stdin, reading capped output, and
asking the bootstrap to kill the program."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time


def collect(proc: subprocess.Popen, stdin: bytes, status_file, deadline: float, cap: int,
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


def stop(proc: subprocess.Popen, control) -> None:
    """Asks the bootstrap to SIGKILL the program (PID 1 of its namespace, so everything in it
    dies and is reaped there); SIGKILLs the bootstrap's process group if it has not ended in 2 s."""
    try:
        # Straight to the pipe: a request the bootstrap can no longer read (it died first) fails
        # here, and nothing is left in a buffer to fail again when the pipe's file closes.
        os.write(control.fileno(), b"k")
    except OSError:
        pass
    try:
        proc.wait(2.0)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def drain(file) -> bytes:
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

