"""Buffer benchmark: the headrace Redis buffer against raw redis-py on the same server.

    headrace bench buffer [--writers 8] [--payload-kib 16] [--duration 20] [--batch 64]
                          [--trajectories 4] [--quick] [--json]
    headrace bench buffer --shards 1,2,4 [same options]

With `--shards`, a different measurement (`run_shards`): for each shard count n, n Redis servers
(each pinned to a core in turn: on 2 cores, 4 servers share them), n reader processes (learner
hosts, each reading its shard), `writers` writer processes whose actor ids spread them evenly over
the shards; flat out for `duration`, then drained. Output: `shards` (per count:
throughput_per_s, put_ms_p50/p99, written_per_shard, written, delivered, exactly_once),
`ratio_2_to_1`, `cores`, `exactly_once`. `--quick` fails unless every group written was delivered
exactly once and every shard received groups.

One `RedisServer` with the embedded default's persistence (appendonly, fsync everysec) serves four
phases, each on fresh keys. Writers are separate processes (as actors are), the reader runs in this
process (as a learner's reader does), so neither side's Python work stalls the other's.

  1. raw, flat out: each writer encodes `batch` groups (`serialize.encode`) and XADDs them in one
     MULTI/EXEC pipeline (readers see whole batches, as with headrace); the reader runs XREADGROUP
     (count 256), decodes each entry (`serialize.decode`), then XACK + XDEL (headrace's deletes).
     Raw writers check XLEN against the same capacity before each pipeline (flow control without
     atomicity, one round trip like headrace's reservation; without it, writers flat out starve
     the reader). Raw serializes like headrace, as any user of Redis must: the ratio isolates the
     buffer's machinery (reservations, transactions, ack script, delivery counts, quarantine).
  2. headrace, flat out: each writer calls `RedisBuffer.put(batch of groups)` (encode, reserve
     capacity in a small script, XADDs in one transaction); the reader calls `get(256)` (reserve,
     XREADGROUP, decode, quarantine check) + `ack` (XACK + XDEL script).
  3./4. headrace, then raw, at an offered load of half raw's throughput: writers put on a fixed
     schedule; the reader polls for up to `batch` groups without blocking. A get's latency is the
     service time of a call that returned data (not time waiting for it); a put's, from its start.

Without `--quick` each phase runs twice, in ABBA order (raw, headrace, headrace, raw; latency
mirrored), half the duration each, and samples are pooled: a shared machine's changing load then
weighs on both sides alike. Throughput is end to end: groups acknowledged per second after a
warm-up (`duration` is the measured time per side and kind, excluding warm-ups). Each group has
`trajectories` trajectories whose arrays add up to `payload-kib`. Output (`--json`):
`{"headrace": {...}, "raw": {...}, "ratio": headrace/raw throughput}` with, inside each,
throughput_per_s, put_ms_p50/p99/p999, get_ms_p50/p99/p999 and offered_per_s.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import uuid

from headrace.benchlib import bench_parser, child_env, emit, payload_group, tail_quantiles
from headrace.buffer.base import BufferFull
from headrace.buffer.redis_stream import FIELD, GROUP, RedisBuffer
from headrace.buffer.serialize import decode, encode
from headrace.buffer.server import RedisServer

READ_COUNT = 256  # groups per get / XREADGROUP when flat out (latency phases read `batch`)


def _raw_stream(run_id: str) -> str:
    return f"bench:{run_id}:raw"


# -- writer process ---------------------------------------------------------------------------

def _writer(spec: dict) -> None:
    """One writer process: waits for the start time, puts until the end, writes latencies."""
    groups = [payload_group(i, spec["payload_bytes"], spec["trajectories"])
              for i in range(spec["batch"])]
    server = RedisServer(spec["dir"], port=spec["port"])
    control = server.client(socket_timeout=30)
    if spec["kind"] == "raw":
        client, stream = server.client(socket_timeout=30), _raw_stream(spec["run_id"])
        backoff = [0.002]

        def put() -> None:
            if client.xlen(stream) + len(groups) > spec["capacity"]:
                # plain flow control (not atomic), backing off like a blocked RedisBuffer.put
                time.sleep(backoff[0])
                backoff[0] = min(backoff[0] * 2, 0.05)
                raise BufferFull(stream)
            backoff[0] = 0.002
            pipe = client.pipeline(transaction=True)  # whole batches, as headrace writes them
            for group in groups:
                pipe.xadd(stream, {FIELD: encode(group)})
            pipe.execute()
    else:
        buffer = RedisBuffer(server.url, run_id=spec["run_id"], consumer="unused",
                             capacity=spec["capacity"])

        def put() -> None:
            buffer.put(groups, timeout_s=1.0)

    start_key = f"bench:{spec['run_id']}:start"
    control.incr(f"bench:{spec['run_id']}:ready")
    while (start := control.get(start_key)) is None:
        time.sleep(0.005)
    start = float(start)
    window_from, end = start + spec["warmup"], start + spec["warmup"] + spec["duration"]
    interval = spec["interval"]
    next_at = start + spec["offset"]
    put_ms = []
    while (now := time.time()) < end:
        if interval:
            if next_at > now:
                time.sleep(next_at - now)
            next_at += interval
        began = time.perf_counter()
        began_wall = time.time()
        try:
            put()
        except BufferFull:
            continue  # flat out against backpressure: try again
        if began_wall >= window_from:
            put_ms.append((time.perf_counter() - began) * 1e3)
    pathlib.Path(spec["out"]).write_text(json.dumps(put_ms))


# -- reader and phases ------------------------------------------------------------------------

class _Phase:
    """Starts writer processes, reads with this process until the end, collects the results."""

    def __init__(self, server: RedisServer, folder: str, kind: str, args: argparse.Namespace,
                 warmup: float, duration: float, offered_per_s: float | None):
        self.server, self.kind, self.args, self.warmup = server, kind, args, warmup
        self.duration = duration
        self.run_id = f"bench-{kind}-{uuid.uuid4().hex[:8]}"
        self.folder = pathlib.Path(folder) / self.run_id
        self.folder.mkdir()
        self.interval = args.writers * args.batch / offered_per_s if offered_per_s else 0.0
        self.capacity = max(4096, 4 * args.writers * args.batch)

    def _spawn(self, k: int) -> subprocess.Popen:
        spec = dict(kind=self.kind, dir=str(self.server.dir), port=self.server.port,
                    run_id=self.run_id, batch=self.args.batch,
                    payload_bytes=int(self.args.payload_kib * 1024),
                    trajectories=self.args.trajectories, capacity=self.capacity,
                    interval=self.interval, offset=k * self.interval / self.args.writers,
                    warmup=self.warmup, duration=self.duration,
                    out=str(self.folder / f"writer{k}.json"))
        log = open(self.folder / f"writer{k}.log", "wb")
        try:
            return subprocess.Popen([sys.executable, "-m", __spec__.name, "--worker",
                                     json.dumps(spec)], stdout=log, stderr=subprocess.STDOUT,
                                    env=child_env())
        finally:
            log.close()

    def run(self) -> dict:
        control = self.server.client(socket_timeout=30)
        count = self.args.batch if self.interval else READ_COUNT
        if self.kind == "raw":
            reader_client = self.server.client(socket_timeout=30)
            stream = _raw_stream(self.run_id)
            reader_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
            cleanup = lambda: reader_client.delete(stream)  # noqa: E731

            def get(block_ms: int | None) -> list:
                reply = reader_client.xreadgroup(GROUP, "reader", {stream: ">"},
                                                 count=count, block=block_ms)
                entries = reply[0][1] if reply else []
                for _, fields in entries:
                    decode(fields[FIELD])
                return [entry_id for entry_id, _ in entries]

            def ack(ids: list) -> None:
                pipe = reader_client.pipeline(transaction=False)
                pipe.xack(stream, GROUP, *ids)
                pipe.xdel(stream, *ids)
                pipe.execute()
        else:
            buffer = RedisBuffer(self.server.url, run_id=self.run_id, consumer="reader",
                                 capacity=self.capacity, max_pending=4 * READ_COUNT)
            stream = buffer.stream_key
            cleanup = buffer.drop

            def get(block_ms: int | None) -> list:
                entries = buffer.get(count, timeout_s=(block_ms or 0) / 1000)
                return [e.id for e in entries]

            ack = buffer.ack
        procs = [self._spawn(k) for k in range(self.args.writers)]
        try:
            self._wait_ready(control, procs)
            start = time.time() + 0.1
            control.set(f"bench:{self.run_id}:start", repr(start))
            window_from = start + self.warmup
            end = window_from + self.duration
            done, get_ms = 0, []
            while (now := time.time()) < end:
                began = time.perf_counter()
                ids = get(None if self.interval else 50)
                if not ids:
                    if self.interval:
                        time.sleep(0.001)
                    continue
                elapsed_ms = (time.perf_counter() - began) * 1e3
                ack(ids)
                if now >= window_from and time.time() < end:
                    done += len(ids)
                    get_ms.append(elapsed_ms)
            put_ms = self._collect(procs)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            cleanup()
            control.delete(f"bench:{self.run_id}:ready", f"bench:{self.run_id}:start")
            control.close()
        return {"done": done, "seconds": self.duration, "put_ms": put_ms,
                "get_ms": get_ms if self.interval else []}

    def _wait_ready(self, control, procs: list[subprocess.Popen]) -> None:
        deadline = time.monotonic() + 120
        while int(control.get(f"bench:{self.run_id}:ready") or 0) < len(procs):
            self._check_alive(procs)
            if time.monotonic() > deadline:
                raise RuntimeError(f"writers did not start within 120 s; logs in {self.folder}")
            time.sleep(0.01)

    def _check_alive(self, procs: list[subprocess.Popen]) -> None:
        for k, proc in enumerate(procs):
            if proc.poll() not in (None, 0):
                log = (self.folder / f"writer{k}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"writer {k} exited with {proc.returncode}:\n{log}")

    def _collect(self, procs: list[subprocess.Popen]) -> list[float]:
        put_ms: list[float] = []
        for k, proc in enumerate(procs):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise RuntimeError(f"writer {k} did not finish") from None
            self._check_alive(procs)
            put_ms.extend(json.loads((self.folder / f"writer{k}.json").read_text()))
        return put_ms


def run(args: argparse.Namespace, warmup: float, rounds: int) -> dict:
    """Flat-out phases in the order raw, headrace (then headrace, raw: ABBA, so drift in a shared
    machine's load cancels), then latency phases in the mirrored order; samples are pooled."""
    throughput_order = ["raw", "headrace"] + ["headrace", "raw"] * (rounds - 1)
    latency_order = ["headrace", "raw"] + ["raw", "headrace"] * (rounds - 1)
    seconds = args.duration / rounds
    flat = {"raw": [], "headrace": []}
    latency = {"raw": [], "headrace": []}
    with tempfile.TemporaryDirectory(prefix="headrace-bench-") as folder:
        with RedisServer(pathlib.Path(folder) / "redis", fsync="everysec") as server:
            for kind in throughput_order:
                flat[kind].append(_Phase(server, folder, kind, args, warmup, seconds, None).run())
            rate = {k: sum(r["done"] for r in v) / sum(r["seconds"] for r in v)
                    for k, v in flat.items()}
            offered = rate["raw"] / 2
            for kind in latency_order:
                latency[kind].append(
                    _Phase(server, folder, kind, args, warmup, seconds, offered).run())

    def side(kind: str) -> dict:
        put_ms = [ms for r in latency[kind] for ms in r["put_ms"]]
        get_ms = [ms for r in latency[kind] for ms in r["get_ms"]]
        (p50, p99, p999), (g50, g99, g999) = tail_quantiles(put_ms), tail_quantiles(get_ms)
        return {"throughput_per_s": rate[kind], "put_ms_p50": p50, "put_ms_p99": p99,
                "put_ms_p999": p999, "get_ms_p50": g50, "get_ms_p99": g99, "get_ms_p999": g999,
                "offered_per_s": offered}

    return {"headrace": side("headrace"), "raw": side("raw"),
            "ratio": rate["headrace"] / max(rate["raw"], 1e-9)}


# -- shards: `--shards 1,2,4` ------------------------------------------------------------------

def _writer_names(writers: int, shards: int) -> list[str]:
    """Actor ids for `writers` writers, `writers / shards` per shard by `shard_of` (a fleet of
    thousands balances by numbers; eight hashed names do not, and the bench measures shards,
    not luck)."""
    from headrace.buffer.sharded import shard_of

    names, j = [], 0
    for k in range(writers):
        while shard_of(f"actor-{j}", shards) != k % shards:
            j += 1
            if j > 100_000:
                raise RuntimeError(f"shard_of never maps an actor id to shard {k % shards}")
        names.append(f"actor-{j}")
        j += 1
    return names


def _sharded(spec: dict, consumer: str, **kwargs):
    from headrace.buffer.sharded import ShardedBuffer

    shards = [RedisBuffer(url, run_id=spec["run_id"], consumer=consumer, shard=i,
                          capacity=spec["capacity"], max_pending=4 * READ_COUNT)
              for i, url in enumerate(spec["urls"])]
    return ShardedBuffer(shards, **kwargs)


def _shard_worker(spec: dict) -> None:
    """A writer (`name`: an actor id, puts flat out to its shard with unique group ids) or a
    reader (`host`: a learner host reading its share, get + ack, then draining on request)."""
    import dataclasses

    from headrace.buffer.sharded import read_shards, shard_of

    control = RedisServer(spec["dirs"][0], port=spec["ports"][0]).client(socket_timeout=30)
    key = f"bench:{spec['run_id']}"
    n = len(spec["urls"])
    if "name" in spec:
        buffer = _sharded(spec, spec["name"], write=shard_of(spec["name"], n))
        template = payload_group(0, spec["payload_bytes"], spec["trajectories"])
    else:
        buffer = _sharded(spec, f"learner-{spec['host']}", read=read_shards(spec["host"], n, n))
    control.incr(f"{key}:ready")
    while (start := control.get(f"{key}:start")) is None:
        time.sleep(0.005)
    window_from = float(start) + spec["warmup"]
    end = window_from + spec["duration"]
    put_ms, ids, done, seq = [], [], 0, 0
    while "name" in spec and time.time() < end:
        groups = []
        for _ in range(spec["batch"]):
            gid = f"{spec['name']}-{seq}"
            seq += 1
            groups.append(dataclasses.replace(template, group_id=gid, trajectories=[
                dataclasses.replace(t, group_id=gid, trajectory_id=f"{gid}-{j}")
                for j, t in enumerate(template.trajectories)]))
        began, began_wall = time.perf_counter(), time.time()
        try:
            buffer.put(groups, timeout_s=1.0)
        except BufferFull:
            continue
        ids += [g.group_id for g in groups]
        if began_wall >= window_from:
            put_ms.append((time.perf_counter() - began) * 1e3)
    while "host" in spec:
        entries = buffer.get(READ_COUNT, timeout_s=0.05)
        if entries:
            buffer.ack([e.id for e in entries])
            ids += [e.group.group_id for e in entries]
            if window_from <= time.time() < end:
                done += len(entries)
        elif time.time() >= end and control.get(f"{key}:drain"):
            if not buffer.get(READ_COUNT, timeout_s=0.2):  # empty twice: drained
                break
    buffer.close()
    pathlib.Path(spec["out"]).write_text(json.dumps({"put_ms": put_ms, "ids": ids,
                                                     "done": done}))


def run_shards(args: argparse.Namespace, counts: list[int], warmup: float) -> dict:
    """For each shard count n: n servers (pinned to cores in turn), n reader processes (one
    learner host per shard), `writers` writer processes spread evenly; aggregate throughput
    (groups acknowledged per second), put latency, and the exactly-once check."""
    cores = sorted(os.sched_getaffinity(0))
    table, exactly_once = {}, True
    with tempfile.TemporaryDirectory(prefix="headrace-bench-") as folder:
        for n in counts:
            servers = [RedisServer(pathlib.Path(folder) / f"s{n}-{i}").start() for i in range(n)]
            try:
                for i, server in enumerate(servers):
                    os.sched_setaffinity(server.pid, {cores[i % len(cores)]})
                table[str(n)], once = _shard_phase(args, servers, folder, warmup)
                exactly_once = exactly_once and once
            finally:
                for server in servers:
                    server.stop()
    one, two = table.get("1"), table.get("2")
    return {"shards": table, "ratio_2_to_1": (two["throughput_per_s"] / one["throughput_per_s"]
                                              if one and two else None),
            "cores": len(cores), "servers_per_core": max(counts) / len(cores),
            "exactly_once": exactly_once}


def _shard_phase(args, servers: list[RedisServer], folder: str, warmup: float):
    import collections

    n, run_id = len(servers), f"bench-shards-{uuid.uuid4().hex[:8]}"
    base = dict(urls=[s.url for s in servers], dirs=[str(s.dir) for s in servers],
                ports=[s.port for s in servers], run_id=run_id, batch=args.batch,
                payload_bytes=int(args.payload_kib * 1024), trajectories=args.trajectories,
                capacity=max(4096, 4 * args.batch * -(-args.writers // n)), warmup=warmup,
                duration=args.duration)
    specs = [dict(base, name=name) for name in _writer_names(args.writers, n)]
    specs += [dict(base, host=h) for h in range(n)]
    env = child_env()
    procs = []
    for k, spec in enumerate(specs):
        spec["out"] = str(pathlib.Path(folder) / f"{run_id}-{k}.json")
        with open(pathlib.Path(folder) / f"{run_id}-{k}.log", "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", __spec__.name,
                                           "--shard-worker", json.dumps(spec)], stdout=log,
                                          stderr=subprocess.STDOUT, env=env))
    control = servers[0].client(socket_timeout=30)
    key = f"bench:{run_id}"
    try:
        deadline = time.monotonic() + 120
        while int(control.get(f"{key}:ready") or 0) < len(procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"bench workers did not start; logs in {folder}")
            time.sleep(0.01)
        control.set(f"{key}:start", repr(time.time() + 0.1))
        writers, readers = procs[:args.writers], procs[args.writers:]
        for proc in writers:
            proc.wait(warmup + args.duration + 120)
        control.set(f"{key}:drain", 1)
        for proc in readers:
            proc.wait(120)
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"a bench worker failed; logs in {folder}")
        results = [json.loads(pathlib.Path(s["out"]).read_text()) for s in specs]
        written = [i for r in results[:args.writers] for i in r["ids"]]
        read = collections.Counter(i for r in results[args.writers:] for i in r["ids"])
        per_shard = [RedisBuffer(s.client(), run_id=run_id, consumer="bench", shard=i).added()
                     for i, s in enumerate(servers)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        control.close()
    once = set(read) == set(written) and len(written) == len(set(written)) \
        and all(c == 1 for c in read.values())
    put_ms = [ms for r in results[:args.writers] for ms in r["put_ms"]]
    (p50, p99, _) = tail_quantiles(put_ms)
    row = {"throughput_per_s": sum(r["done"] for r in results[args.writers:]) / args.duration,
           "put_ms_p50": p50, "put_ms_p99": p99, "written_per_shard": per_shard,
           "written": len(written), "delivered": sum(read.values()), "exactly_once": once}
    return row, once


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        _writer(json.loads(argv[1]))
        return 0
    if argv[:1] == ["--shard-worker"]:
        _shard_worker(json.loads(argv[1]))
        return 0
    parser = argparse.ArgumentParser(prog="headrace bench buffer", parents=[bench_parser()],
                                     description="headrace's Redis buffer vs raw redis-py")
    parser.add_argument("--writers", type=int, default=8, help="writer processes")
    parser.add_argument("--payload-kib", type=float, default=16.0, help="group size in KiB")
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds per phase")
    parser.add_argument("--batch", type=int, default=64, help="groups per put / pipeline")
    parser.add_argument("--trajectories", type=int, default=4, help="trajectories per group")
    parser.add_argument("--shards", default="", metavar="N,N,...",
                        help="instead: aggregate throughput and put latency per shard count "
                        "(one Redis per shard, one reader per shard)")
    args = parser.parse_args(argv)
    if min(args.writers, args.batch, args.trajectories) < 1 or args.payload_kib <= 0 \
            or args.duration <= 0:
        parser.error("--writers, --batch, --trajectories must be >= 1; --payload-kib and "
                     "--duration > 0")
    if args.quick:  # 3 s: even on a loaded machine each side and shard puts and gets in it
        args.writers, args.duration, args.batch = min(args.writers, 2), 3.0, min(args.batch, 16)
    warmup = 0.25 if args.quick else min(2.0, args.duration / 5)
    if args.shards:
        try:
            counts = [int(c) for c in args.shards.split(",")]
        except ValueError:
            counts = []
        if not counts or min(counts) < 1:
            parser.error(f"--shards {args.shards!r}: a comma-separated list of counts >= 1")
        if args.quick:
            args.writers = max(counts)  # one writer per shard at the most
        print(f"buffer bench, shards {counts}: {args.writers} writer processes, "
              f"{args.payload_kib:g} KiB groups, batches of {args.batch}, {args.duration:g} s "
              "each", file=sys.stderr)
        result = run_shards(args, counts, warmup)
        emit(result, as_json=args.json, title="buffer: throughput by shard count")
        if args.quick:  # what broken sharding would fail
            for n, row in result["shards"].items():
                if not row["exactly_once"] or min(row["written_per_shard"]) < 1:
                    print(f"buffer bench: {n} shards: delivered {row['delivered']} of "
                          f"{row['written']} (exactly once: {row['exactly_once']}), written per "
                          f"shard {row['written_per_shard']}", file=sys.stderr)
                    return 1
        return 0
    print(f"buffer bench: {args.writers} writer processes, {args.payload_kib:g} KiB groups of "
          f"{args.trajectories} trajectories, batches of {args.batch}, {args.duration:g} s per "
          "phase (raw, headrace flat out; then both at half raw's throughput)", file=sys.stderr)
    result = run(args, warmup, rounds=1 if args.quick else 2)
    emit(result, as_json=args.json, title="buffer: headrace vs raw redis-py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
