"""Weight-sync benchmark: publish -> pickup latency and bytes moved, directory store vs Redis store.

    headrace bench weights [--sizes 1M,135M,1B] [--repeats N] [--chunk-mib 8] [--quick] [--json]

For each size (random parameters in tensors of at most 16M elements: float32 up to 135M, bfloat16
at 1B) and each store, two processes besides this one, as a learner and an actor are:

  publisher  builds the parameters once, then on each command publishes them as the next version
             (one small tensor changes per version, so a reader that loads a stale version fails
             the comparison) and reports its start and end time, the bytes its syscalls wrote
             (`wchar` of /proc/self/io) and each array's crc32.
  reader     polls `latest_version()` every millisecond; on a new version it loads it (the
             arrays are then in host memory: `host` time), puts them on the default JAX device
             and waits for them (`device` time), then reports the bytes its syscalls read during
             the load (`rchar`) and each array's crc32.

Pickup = the reader's host (device) time minus the publisher's start: what an actor waits from
the moment the learner begins publishing. Versions are published one at a time (the next after
the reader reported the previous one); `weights.keep` is 2. The directory store writes under the
system temp folder with fsync on (as runs do); the Redis store goes to a fresh `redis-server`
without persistence (no append-only file, no snapshots), as the bench's own server. Peak RSS is
each process's VmHWM; the Redis server's own peak is `used_memory_peak`.

LoRA rows (`<store>_<size>_lora`): the same, publishing what a `model.lora` run publishes instead:
the adapters alone, rank 16 on all seven projections (q, k, v, o, gate, up, down) of a model of
that size and shape (LORA_MODELS: a 4-layer toy at 1M, SmolLM2-135M, Llama-3.2-1B), as tensors of
their real shapes ([in, r] and [r, out], two per projection and layer), in the model's dtype;
`bytes_vs_full` is their bytes over the full weights'. (An actor then merges them into its base
on device; that time is not part of the pickup here: docs/weights.md has it.)

`--quick` (the suite's) runs 1M only and asserts what a broken store would fail: bytes moved
through the publisher's and reader's syscalls are the parameter bytes (within the manifest's and
protocol's overhead), every loaded array equals the published one (crc32 per array, the changing
tensor included), and the pointer is written last (Redis: the server's MONITOR order; directory:
the pointer file is not older than any file of its version).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import select
import subprocess
import sys
import tempfile
import threading
import time
import zlib

import numpy as np

from headrace import benchlib
from headrace.benchlib import bench_parser
from headrace.weights.redis_store import chunk_bytes_for

SIZES = {"1M": 1_000_000, "135M": 135_000_000, "1B": 1_000_000_000}
# A model of each size, for its LoRA adapters: (layers, d_model, q heads, kv heads, head, ffn)
LORA_MODELS = {"1M": (4, 128, 4, 2, 32, 344), "135M": (30, 576, 9, 3, 64, 1536),
               "1B": (16, 2048, 32, 8, 64, 8192)}
LORA_RANK = 16
MAX_TENSOR = 16 << 20  # elements per tensor at most
ROW = 1024
KEEP = 2
# Overheads allowed on top of the parameter bytes in --quick: the manifest (about 200 bytes per
# array) and the protocol's framing (Redis: ~60 bytes per chunk command and reply).
OVERHEAD_BYTES = 64 << 10
POLL_S = 0.001  # the reader polls latest_version() this often
# Redis: the server's byte counters over a version also count the reader's polls (a GET of the
# pointer and its reply: under 128 bytes each way), at most one per POLL_S of the version's span;
# a slow publish on a loaded machine is polled through for seconds, past OVERHEAD_BYTES.
POLL_BYTES = 128


# --- the parameters --------------------------------------------------------------------------


def make_params(size: int, dtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Random parameters totalling `size` elements (plus a 1024-element per-version tensor).

    Random bit patterns with the exponent's top bit cleared: finite values in (-2, 2), made
    without a float pass over the data (1B values in seconds)."""
    rng = np.random.default_rng(seed)
    bits, mask, view = ((np.uint16, 0xBFFF, "bfloat16") if dtype == "bfloat16"
                        else (np.uint32, 0xBFFFFFFF, "float32"))
    import ml_dtypes

    target = np.dtype(ml_dtypes.bfloat16) if view == "bfloat16" else np.dtype(np.float32)
    params: dict[str, np.ndarray] = {}
    left, index = size, 0
    while left > 0:
        count = min(left, MAX_TENSOR)
        rows = max(count // ROW, 1)
        shape = (rows, ROW) if rows * ROW == count else (count,)
        raw = rng.integers(0, np.iinfo(bits).max, size=count, dtype=bits, endpoint=True)
        raw &= bits(mask)
        params[f"layers.{index}.kernel"] = raw.view(target).reshape(shape)
        left -= count
        index += 1
    return params


def lora_shapes(size_name: str, rank: int = LORA_RANK) -> dict[str, tuple[int, int]]:
    """{flat key: shape} of rank-`rank` adapters on every projection of the size's model."""
    layers, d, h, g, e, f = LORA_MODELS[size_name]
    ins_outs = {"attn.q": (d, h * e), "attn.k": (d, g * e), "attn.v": (d, g * e),
                "attn.o": (h * e, d), "mlp.gate": (d, f), "mlp.up": (d, f), "mlp.down": (f, d)}
    shapes = {}
    for i in range(layers):
        for path, (d_in, d_out) in ins_outs.items():
            shapes[f"layers.{i}.{path}.lora_a"] = (d_in, rank)
            shapes[f"layers.{i}.{path}.lora_b"] = (rank, d_out)
    return shapes


def make_lora_params(size_name: str, dtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Random adapters of the size's model (`lora_shapes`), finite values as `make_params`'."""
    shapes = lora_shapes(size_name)
    flat = make_params(sum(a * b for a, b in shapes.values()), dtype, seed)
    values = np.concatenate([v.reshape(-1) for v in flat.values()])
    out, offset = {}, 0
    for key, (a, b) in shapes.items():
        out[key] = values[offset:offset + a * b].reshape(a, b)
        offset += a * b
    return out


def _stamp(params: dict[str, np.ndarray], version: int) -> None:
    params["stamp"] = np.full((ROW,), version, np.float32)


def _crcs(params: dict[str, np.ndarray]) -> list[int]:
    return [zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8)) for a in params.values()]


def _proc_io(field: str) -> int:
    for line in pathlib.Path("/proc/self/io").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/io has no {field}")


def _vm(field: str) -> int:
    """A /proc/self/status size in bytes (VmHWM: peak resident set; VmRSS: now)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _open_store(spec: dict):
    if spec["kind"] == "dir":
        from headrace.weights.directory import DirWeightStore

        return DirWeightStore(spec["path"], keep=KEEP)
    from headrace.weights.redis_store import RedisWeightStore

    return RedisWeightStore(spec["url"], "bench", keep=KEEP, chunk_bytes=spec["chunk_bytes"])


# --- the two roles (separate processes; JSON lines on stdin/stdout) -----------------------------


def _send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def publisher_main(spec: dict) -> None:
    store = _open_store(spec)
    params = (make_lora_params(spec["lora"], spec["dtype"]) if spec.get("lora")
              else make_params(spec["size"], spec["dtype"]))
    _stamp(params, -1)
    big = _crcs({k: v for k, v in params.items() if k != "stamp"})
    _send({"ready": True, "rss": _vm("VmRSS"),
           "bytes": sum(a.nbytes for a in params.values())})
    for line in sys.stdin:
        version = json.loads(line)["publish"]
        if version < 0:
            break
        _stamp(params, version)
        wrote = _proc_io("wchar")
        start = time.time()
        store.publish(params, version)
        end = time.time()
        _send({"version": version, "start": start, "end": end,
               "wrote": _proc_io("wchar") - wrote, "crcs": big + _crcs({"s": params["stamp"]})})
    store.close()
    _send({"peak_rss": _vm("VmHWM")})


def reader_main(spec: dict) -> None:
    import jax

    store = _open_store(spec)
    device = jax.devices()[0]
    jax.block_until_ready(jax.device_put(np.zeros(4, np.float32), device))  # start-up, not timed
    seen = store.latest_version()  # before `ready`: the driver publishes the next one then
    _send({"ready": True, "rss": _vm("VmRSS")})
    last = spec["last"]
    while seen < last:
        version = store.latest_version()
        if version <= seen:
            time.sleep(POLL_S)
            continue
        read = _proc_io("rchar")
        began = time.time()
        params = store.load(version)
        host = time.time()
        read = _proc_io("rchar") - read
        on_device = jax.block_until_ready(jax.device_put(params, device))  # the intended sync
        done = time.time()
        del on_device
        _send({"version": version, "began": began, "host": host, "device": done, "read": read,
               "crcs": _crcs(params)})
        del params
        seen = version
    store.close()
    _send({"peak_rss": _vm("VmHWM")})


# --- the driver ----------------------------------------------------------------------------


class Child:
    """A child process of this benchmark: JSON lines in and out, reads with a timeout."""

    def __init__(self, role: str, spec: dict):
        self.role = role
        self.process = subprocess.Popen(
            [sys.executable, "-m", __spec__.name, "--role", role, json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=benchlib.child_env())
        self._pending = b""

    def send(self, message: dict) -> None:
        self.process.stdin.write((json.dumps(message) + "\n").encode())

    def receive(self, timeout_s: float = 900.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            ready, _, _ = select.select([self.process.stdout], [], [],
                                        max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError(f"the {self.role} sent nothing for {timeout_s:.0f} s")
            data = os.read(self.process.stdout.fileno(), 1 << 16)
            if not data:
                raise RuntimeError(f"the {self.role} exited (code {self.process.wait()}) "
                                   "before answering")
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class PointerOrder:
    """Checks the pointer is written after every other write of a version.

    Redis: the commands as the server executed them (MONITOR, admin connection). Directory: the
    pointer file's mtime is not older than any file of the version (a pointer written first is
    older than the arrays written after it)."""

    def __init__(self, spec: dict, server=None):
        self.spec, self.server = spec, server
        self.commands: list[str] = []
        self._thread = None
        if spec["kind"] == "redis":
            self._client = server.client()
            self._monitor = self._client.monitor().__enter__()
            self._thread = threading.Thread(target=self._watch, daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        try:
            for event in self._monitor.listen():
                self.commands.append(event["command"][:120])
        except Exception:  # the connection is closed by `check`
            pass

    def check(self, version: int) -> bool:
        if self.spec["kind"] == "dir":
            root = pathlib.Path(self.spec["path"])
            pointer = (root / "LATEST").stat().st_mtime_ns
            files = [p.stat().st_mtime_ns for p in (root / f"v{version}").iterdir()]
            return bool(files) and pointer >= max(files)
        def is_pointer(command: str) -> bool:
            words = command.split()
            return words[:1] == ["SET"] and words[1].endswith(":latest") and \
                words[2:3] == [str(version)]

        # MONITOR trails execution (parsing megabytes of escaped chunks): wait for the pointer.
        deadline = time.monotonic() + 120
        while not any(map(is_pointer, list(self.commands))) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._monitor.connection.disconnect()
        self._thread.join(timeout=10)
        self._client.close()
        writes = [i for i, c in enumerate(self.commands)
                  if c.startswith("HSET") and f":v{version}" in c]
        pointer = [i for i, c in enumerate(self.commands) if is_pointer(c)]
        return bool(writes) and len(pointer) == 1 and max(writes) < pointer[0]


def run_case(kind: str, size_name: str, repeats: int, chunk_mib: int, quick: bool,
             lora: bool = False) -> dict:
    """One store and size: full weights, or (`lora`) the adapters of a model of that size."""
    size = SIZES[size_name]
    dtype = "bfloat16" if size >= 1_000_000_000 else "float32"
    if lora:
        size = sum(a * b for a, b in lora_shapes(size_name).values())
    server = None
    with tempfile.TemporaryDirectory(prefix="headrace-bench-weights-") as scratch:
        spec = {"kind": kind, "size": size, "dtype": dtype, "last": repeats,
                "lora": size_name if lora else "",
                "chunk_bytes": chunk_bytes_for(chunk_mib),
                "path": str(pathlib.Path(scratch) / "weights")}
        if kind == "redis":
            from headrace.buffer.server import RedisServer

            server = RedisServer(pathlib.Path(scratch) / "redis").start()
            admin = server.client()
            admin.config_set("appendonly", "no")  # no persistence on the weights' server
            spec["url"] = server.url
        publisher = Child("publisher", spec)
        reader = None
        try:
            ready = publisher.receive()
            param_bytes = ready["bytes"]
            publisher.send({"publish": 0})
            publisher.receive()  # version 0, before the reader starts
            reader = Child("reader", spec)
            reader_ready = reader.receive()
            rows, ordered = [], True
            for version in range(1, repeats + 1):
                monitored = quick and version == repeats  # MONITOR's output: not counted
                order = PointerOrder(spec, server) if monitored else None
                span_start = time.monotonic()
                net = admin.info("stats") if server else None
                publisher.send({"publish": version})
                published = publisher.receive()
                picked = reader.receive()
                if picked["version"] != version:
                    raise RuntimeError(f"{kind}: the reader picked up {picked['version']}, "
                                       f"not {version}")
                if order is not None:
                    ordered = order.check(version)
                row = {"publish_s": published["end"] - published["start"],
                       "pickup_host_s": picked["host"] - published["start"],
                       "pickup_device_s": picked["device"] - published["start"],
                       "load_s": picked["host"] - picked["began"],
                       "notice_s": picked["began"] - published["start"],
                       "wrote": published["wrote"], "read": picked["read"],
                       "equal": picked["crcs"] == published["crcs"], "monitored": monitored}
                if server is not None:  # sockets: the server's own byte counts, both ways
                    after = admin.info("stats")
                    row["wrote"] = after["total_net_input_bytes"] - net["total_net_input_bytes"]
                    row["read"] = after["total_net_output_bytes"] - net["total_net_output_bytes"]
                    row["polled_s"] = time.monotonic() - span_start  # the counters' span
                rows.append(row)
            publisher.send({"publish": -1})
            publisher_peak = publisher.receive()["peak_rss"]
            reader_peak = reader.receive()["peak_rss"]
            memory = admin.info("memory") if server else {}
        finally:
            for child in (publisher, reader):
                if child is not None:
                    child.close()
            if server is not None:
                admin.close()
                server.stop()
    mib = float(1 << 20)
    result = {
        "params": size, "dtype": dtype, "param_mib": param_bytes / mib, "repeats": repeats,
        "publish_s_p50": _percentile([r["publish_s"] for r in rows], 50),
        "pickup_s_p50": _percentile([r["pickup_host_s"] for r in rows], 50),
        "pickup_s_p90": _percentile([r["pickup_host_s"] for r in rows], 90),
        "pickup_device_s_p50": _percentile([r["pickup_device_s"] for r in rows], 50),
        "pickup_device_s_p90": _percentile([r["pickup_device_s"] for r in rows], 90),
        "load_s_p50": _percentile([r["load_s"] for r in rows], 50),
        "notice_s_p50": _percentile([r["notice_s"] for r in rows], 50),
        "published_mib": float(np.median([r["wrote"] for r in rows])) / mib,
        "loaded_mib": float(np.median([r["read"] for r in rows])) / mib,
        "publisher_peak_rss_mib": publisher_peak / mib,
        "publisher_rss_before_mib": ready["rss"] / mib,
        "reader_peak_rss_mib": reader_peak / mib,
        "reader_rss_before_mib": reader_ready["rss"] / mib,
        "all_equal": all(r["equal"] for r in rows),
        "pointer_last": ordered if quick else None,
    }
    if server is not None:  # the end: `keep` versions; the peak: during a publish
        result["server_used_mib"] = memory["used_memory"] / mib
        result["server_peak_mib"] = memory["used_memory_peak"] / mib
    result["_rows"] = rows
    result["_param_bytes"] = param_bytes
    return result


def check_quick(name: str, case: dict) -> list[str]:
    """What a broken store would fail; returns the failures (empty: all held)."""
    failures = []
    expected = case["_param_bytes"]
    for row in case["_rows"]:
        polls = row.get("polled_s", 0.0) / POLL_S * POLL_BYTES  # Redis: the reader's polls
        for what in ("wrote", "read") if not row["monitored"] else ():
            if not expected <= row[what] <= expected * 1.01 + OVERHEAD_BYTES + polls:
                failures.append(f"{name}: {what} {row[what]} bytes for {expected} bytes of "
                                "parameters")
    if not case["all_equal"]:
        failures.append(f"{name}: a loaded array differs from the published one")
    if not case["pointer_last"]:
        failures.append(f"{name}: the pointer was not written last")
    return failures


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--role"]:  # a child process of this benchmark
        role, spec = argv[1], json.loads(argv[2])
        (publisher_main if role == "publisher" else reader_main)(spec)
        return 0
    parser = argparse.ArgumentParser(prog="headrace bench weights", parents=[bench_parser()],
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1M,135M,1B",
                        help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--repeats", type=int, default=0,
                        help="versions published per size and store (0: 10 at 1M, 5 at 135M, "
                             "3 at 1B; 5 with --quick)")
    parser.add_argument("--chunk-mib", type=int, default=8, help="the Redis store's chunk size")
    args = parser.parse_args(argv)
    sizes = ["1M"] if args.quick else [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown size(s) {unknown}: choose from {', '.join(SIZES)}")
    result: dict = {}
    failures: list[str] = []
    for size in sizes:
        repeats = args.repeats or (5 if args.quick else {"1M": 10, "135M": 5, "1B": 3}[size])
        for kind in ("dir", "redis"):
            for lora in (False, True):
                name = f"{kind}_{size}" + ("_lora" if lora else "")
                case = run_case(kind, size, repeats, args.chunk_mib, args.quick, lora)
                if args.quick:
                    failures += check_quick(name, case)
                case.pop("_rows")
                case.pop("_param_bytes")
                if lora:
                    case["lora_rank"] = LORA_RANK
                    case["bytes_vs_full"] = case["param_mib"] / result[f"{kind}_{size}"][
                        "param_mib"]
                result[name] = case
                print(f"{name}: pickup p50 {case['pickup_s_p50']:.3f} s", file=sys.stderr)
    if args.quick:
        result["checks_passed"] = not failures
    return benchlib.finish(result, failures, as_json=args.json, title="weights: publish -> pickup")


if __name__ == "__main__":
    sys.exit(main())
