"""Redis weight store: versioned parameters as bounded chunks in a Redis server, for nodes that
share no filesystem (`weights.backend: redis`).

Keys, under `headrace:weights:{namespace}:` (the client ACL allows `headrace:*` only):

```
latest           string: the newest complete version, as decimal text (written last)
index            sorted set: every version whose hash may exist (added before its first chunk)
pickups          hash: version -> unix time an actor first sampled with it (HSETNX: first wins)
v{version}       hash: one version, whole
  manifest         JSON: format, version, created time, byteorder, total_bytes, chunk_bytes, and
                   per array: dotted path, field, dtype, shape, byte count, crc32, chunk count
  {field}:{i}      chunk i of an array's raw little-endian C-order bytes (chunk_bytes each, the
                   last one shorter)
```

Publishing (one process only) streams the arrays one at a time, each in chunks of `chunk_bytes`
(a pipeline holds at most `PIPELINE_CHUNKS` of them), then writes the manifest into the version's
hash, and only then SETs `latest`. A version is *published* exactly when the pointer names it (or
a later one): a publisher that dies earlier leaves the previous version current, and its partial
hash is deleted by the next publish (the index remembers it). After the pointer moves, versions
older than the newest `keep` are UNLINKed, each hash in one command, so a reader finds a version
whole or not at all. Nothing here holds a whole model in one buffer: the publisher's extra memory
is one host copy of one array plus the pipeline's chunks; a reader's is the array it fills plus
`PIPELINE_CHUNKS` chunks.

Loading (any number of processes and threads) reads the manifest, validates every record before
reading a chunk (dtype, shape against byte count, chunk count against chunk size, fields that are
plain names), then fills each array chunk by chunk and checks its crc32. A version pruned
before or while it is read raises `VersionGone`; a missing or wrong-sized chunk, or a checksum
that does not match, raises `CorruptWeights` naming the parameter.

The reading side imports neither JAX nor anything of the learner: numpy, ml_dtypes and redis-py.
Persistence is the server's: with the run's embedded Redis (append-only file) every publish is
also appended to its file; for large models give `weights.url` of a server without persistence
(docs/runtime.md, "Weights without a shared filesystem").
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
import zlib
from collections.abc import Mapping

import numpy as np
import redis
from redis.backoff import ExponentialBackoff
from redis.connection import Encoder, PythonRespSerializer
from redis.retry import Retry

from headrace.weights.base import Params, VersionGone, WeightStore
from headrace.weights.format import (
    FORMAT,
    CorruptWeights,
    check_params,
    check_version,
    host_arrays,
    is_plain_name,
    parse_record,
)

PREFIX = "headrace:weights"
MANIFEST = "manifest"
# A chunk of exactly 8 MiB plus Redis's string header lands in jemalloc's 10 MiB size class (the
# classes past 8 MiB are 10, 12, 14, 16): the server would hold 1.25x the model. Chunks are
# therefore a whole number of MiB less this headroom (measured: `docs/weights.md`).
CHUNK_HEADROOM = 4096


def chunk_bytes_for(mib: int) -> int:
    """The chunk size for `weights.chunk_mib`: `mib` MiB less `CHUNK_HEADROOM`."""
    return (mib << 20) - CHUNK_HEADROOM


DEFAULT_CHUNK_BYTES = chunk_bytes_for(8)  # far below Redis's 512 MiB bulk limit, few round trips
MAX_CHUNK_BYTES = 64 << 20  # x PIPELINE_CHUNKS stays well under client-query-buffer-limit (1 GiB)
PIPELINE_CHUNKS = 4  # chunks in flight per round trip, both ways


class RedisWeightStore(WeightStore):
    """Weight store in Redis; safe for one publisher and many concurrent readers anywhere that
    reaches the server.

    Args:
      url: `redis://[user@]host:port/db` of the server.
      namespace: separates runs sharing one server (keys `headrace:weights:{namespace}:*`; Redis
        keys are binary-safe, so any non-empty string).
      keep: versions kept after each publish (>= 1); older ones are pruned.
      password: the AUTH password (None: the URL's, or none).
      chunk_bytes: bytes per chunk of an array (1 .. 64 MiB).

    Attributes (as the directory store's, for `weights/publish_s` and `weights/pickup_s`):
      last_publish_s, last_publish_bytes, last_load_s, last_load_bytes.

    Raises:
      ValueError: `keep` < 1, a bad namespace or chunk size.
    """

    def __init__(self, url: str, namespace: str = "default", keep: int = 2, *,
                 password: str | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        if keep < 1:
            raise ValueError(f"keep={keep}: must be >= 1")
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace={namespace!r}: must be a non-empty string")
        if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes={chunk_bytes}: must be in 1 .. {MAX_CHUNK_BYTES}")
        self.url, self.namespace, self.keep = url, namespace, keep
        self.chunk_bytes = int(chunk_bytes)
        # Reads and chunk writes are idempotent: transient connection errors are retried. The
        # pure-Python packer sends a chunk's memoryview as it is (hiredis's copies it twice).
        self._client = redis.Redis.from_url(
            url, password=password, socket_timeout=120, socket_connect_timeout=10,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), 5),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
            command_packer=PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode))
        self._key = f"{PREFIX}:{namespace}:"
        self._publish_lock = threading.Lock()
        self.last_publish_s = float("nan")
        self.last_publish_bytes = 0
        self.last_load_s = float("nan")
        self.last_load_bytes = 0

    def __repr__(self) -> str:  # the URL carries no password (docs/runtime.md, "Security")
        return f"RedisWeightStore(namespace={self.namespace!r}, keep={self.keep})"

    @property
    def pointer_key(self) -> str:
        return self._key + "latest"

    def version_key(self, version: int) -> str:
        return f"{self._key}v{version}"

    def close(self) -> None:
        self._client.close()

    # --- pickups (tracing) ----------------------------------------------------------------------

    def note_pickup(self, version: int, at: float) -> None:
        self._client.hsetnx(self._key + "pickups", str(version), repr(at))

    def pickup_time(self, version: int) -> float | None:
        value = self._client.hget(self._key + "pickups", str(version))
        return float(value) if value is not None else None

    # --- reading -------------------------------------------------------------------------------

    def latest_version(self) -> int:
        """The version the pointer names, or -1 before the first publish (one GET).

        Raises:
          CorruptWeights: the pointer does not hold a version number.
        """
        value = self._client.get(self.pointer_key)
        if value is None:
            return -1
        try:
            return int(value)
        except ValueError:
            raise CorruptWeights(f"Redis key {self.pointer_key} holds {value[:40]!r}, not a "
                                 "version number; delete it to start the store afresh") from None

    def versions(self) -> list[int]:
        """Published versions still stored, oldest first."""
        latest = self.latest_version()
        return [int(v) for v in self._client.zrangebyscore(self._key + "index", 0, latest)
                if self._client.exists(self.version_key(int(v)))]

    def load(self, version: int) -> Params:
        """Reads and verifies `version`; the arrays are fresh, writable copies.

        Raises:
          VersionGone: `version` was pruned (also while this call was reading it), or has not
            been published.
          CorruptWeights: the manifest is malformed, or a chunk is missing, has the wrong size,
            or an array fails its checksum (the message names the parameter).
        """
        start = time.perf_counter()
        latest = self.latest_version()
        if not 0 <= version <= latest:
            raise VersionGone(f"weights version {version} is not published in Redis under "
                              f"{self._key}* (latest: {latest})")
        key = self.version_key(version)
        raw = self._client.hget(key, MANIFEST)
        if raw is None:
            raise VersionGone(f"weights version {version} was pruned from Redis "
                              f"(kept: {self.versions()})")
        records, chunk_bytes = self._parse_manifest(raw, key, version)
        params: Params = {}
        total = 0
        for name, field, dtype, shape, nbytes, crc, chunks in records:
            params[name] = self._read_array(key, version, name, field, dtype, shape, nbytes,
                                            crc, chunks, chunk_bytes)
            total += nbytes
        self.last_load_s = time.perf_counter() - start
        self.last_load_bytes = total
        return params

    def _parse_manifest(self, raw: bytes, key: str, version: int):
        where = f"the manifest of {key}"
        try:
            manifest = json.loads(raw)
            ok = (manifest["format"] == FORMAT and manifest["version"] == version
                  and isinstance(manifest["arrays"], list)
                  and isinstance(manifest["chunk_bytes"], int)
                  and 1 <= manifest["chunk_bytes"] <= MAX_CHUNK_BYTES)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise CorruptWeights(f"{where} is not a format-{FORMAT} manifest of version "
                                 f"{version}; republish the version")
        if manifest.get("byteorder", "little") != sys.byteorder:
            raise CorruptWeights(f"{where} was written on a {manifest['byteorder']}-endian host; "
                                 f"this host is {sys.byteorder}-endian")
        chunk_bytes = manifest["chunk_bytes"]
        records, names, fields = [], set(), set()
        for record in manifest["arrays"]:
            name, dtype, shape, nbytes, crc = parse_record(record, where)
            field, chunks = record.get("field"), record.get("chunks")
            if not is_plain_name(field) or field == MANIFEST or field in fields:
                raise CorruptWeights(f"{where}: parameter {name!r} names the field {field!r}, "
                                     "which is not a plain, unique name (':', separators, '..' "
                                     "are refused); the manifest is forged or corrupt: "
                                     "republish the version")
            if chunks != math.ceil(nbytes / chunk_bytes) or name in names:
                raise CorruptWeights(f"{where}: parameter {name!r} claims {chunks!r} chunks for "
                                     f"{nbytes} bytes in chunks of {chunk_bytes} (or is named "
                                     "twice); republish the version")
            names.add(name)
            fields.add(field)
            records.append((name, field, dtype, shape, nbytes, crc, chunks))
        return records, chunk_bytes

    def _read_array(self, key: str, version: int, name: str, field: str, dtype: np.dtype,
                    shape: tuple[int, ...], nbytes: int, crc: int, chunks: int,
                    chunk_bytes: int) -> np.ndarray:
        array = np.empty(shape, dtype)
        flat = array.reshape(-1).view(np.uint8)
        actual = 0
        for first in range(0, chunks, PIPELINE_CHUNKS):
            pipe = self._client.pipeline(transaction=False)
            batch = range(first, min(first + PIPELINE_CHUNKS, chunks))
            for index in batch:
                pipe.hget(key, f"{field}:{index}")
            for index, data in zip(batch, pipe.execute()):
                offset = index * chunk_bytes
                size = min(chunk_bytes, nbytes - offset)
                if data is None:
                    if not self._client.exists(key):
                        raise VersionGone(f"weights version {version} was pruned while being "
                                          "read; load a newer one")
                    raise CorruptWeights(f"weights version {version}: chunk {index} of "
                                         f"parameter {name!r} is missing from {key}; republish "
                                         "the version")
                if len(data) != size:
                    raise CorruptWeights(f"weights version {version}: chunk {index} of "
                                         f"parameter {name!r} is {len(data)} bytes, not {size}; "
                                         "republish the version")
                flat[offset:offset + size] = np.frombuffer(data, np.uint8)
                actual = zlib.crc32(data, actual)
        if actual != crc:
            raise CorruptWeights(f"weights version {version}: parameter {name!r} in {key} has "
                                 f"crc32 {actual:08x}, the manifest says {crc:08x}; the data is "
                                 "corrupt: republish the version or load another")
        return array

    # --- writing -------------------------------------------------------------------------------

    def publish(self, params: Mapping[str, np.ndarray], version: int) -> None:
        """Streams `params` into Redis as `version`, moves the pointer to it, prunes old ones.

        Blocks for the whole write (about one pass over the bytes through the socket). `params`
        may hold jax arrays; each is copied to the host just before it is written.

        Raises:
          ValueError: `version` is not an int newer than the latest, `params` is empty, a key is
            not a non-empty string, or an array has an unsupported dtype.
          redis.RedisError: the server failed (out of memory, unreachable); the previous
            version stays current.
        """
        start = time.perf_counter()
        version = check_version(version)
        check_params(params)
        with self._publish_lock:
            latest = self.latest_version()
            if version <= latest:
                raise ValueError(f"version {version} is not newer than {latest} in Redis under "
                                 f"{self._key}*")
            key = self.version_key(version)
            self._client.unlink(key)  # a crashed publish of this version, never published
            self._client.zadd(self._key + "index", {str(version): version})
            records, total = [], 0
            for index, (path, array) in enumerate(host_arrays(params)):
                field = f"{index:05d}"
                chunks, crc = self._write_array(key, field, array)
                records.append({"path": path, "field": field, "dtype": array.dtype.name,
                                "shape": list(array.shape), "nbytes": int(array.nbytes),
                                "crc32": crc, "chunks": chunks})
                total += array.nbytes
            manifest = {"format": FORMAT, "version": version, "created": time.time(),
                        "byteorder": sys.byteorder, "total_bytes": total,
                        "chunk_bytes": self.chunk_bytes, "arrays": records}
            self._client.hset(key, MANIFEST, json.dumps(manifest))
            self._client.set(self.pointer_key, str(version))  # last: now it is published
            self._prune(version)
        self.last_publish_s = time.perf_counter() - start
        self.last_publish_bytes = total

    def _write_array(self, key: str, field: str, array: np.ndarray) -> tuple[int, int]:
        """Writes one array's chunks; returns (chunk count, crc32)."""
        data = memoryview(array.reshape(-1).view(np.uint8))
        size = self.chunk_bytes
        chunks = math.ceil(len(data) / size)
        crc = 0
        for first in range(0, chunks, PIPELINE_CHUNKS):
            pipe = self._client.pipeline(transaction=False)
            for index in range(first, min(first + PIPELINE_CHUNKS, chunks)):
                chunk = data[index * size:(index + 1) * size]  # a view: no copy
                crc = zlib.crc32(chunk, crc)
                pipe.hset(key, f"{field}:{index}", chunk)
            pipe.execute()
        return chunks, crc

    def _prune(self, latest: int) -> None:
        """Deletes versions older than the newest `keep` and partial ones of crashed publishes
        (in the index above `latest`), then pickup notes far behind the oldest kept version."""
        index = self._key + "index"
        stored = sorted(int(v) for v in self._client.zrange(index, 0, -1))
        kept = [v for v in stored if v <= latest][-self.keep:]
        for version in stored:
            if version not in kept:
                self._client.unlink(self.version_key(version))  # the whole version, at once
                self._client.zrem(index, str(version))
        pickups = self._key + "pickups"
        stale = [f for f in self._client.hkeys(pickups) if int(f) < kept[0] - 64]
        if stale:  # late readers' slack, as the directory store's
            self._client.hdel(pickups, *stale)
