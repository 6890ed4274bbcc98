"""Directory weight store: versioned parameters as plain files on a local or shared filesystem.

Layout under the store's root (docs/design.md, "Weight store"):

```
LATEST                 the newest complete version, as decimal text (written last)
v{version}/
  manifest.json        format, version, created time, and per array: dotted path, file, offset,
                       dtype, shape, byte count, crc32 (in the order the parameters were given)
  arrays.bin           every array's raw little-endian bytes, C order, each at its offset (a
                       multiple of 64; zeros between)
```
(Format 1, written before format 2 and still read: one file per array, `00000.bin` ..., no
offsets.)

Publishing (one process only) writes the arrays and the manifest into a staging directory
`.tmp-v{version}-*`, fsyncing both files, fsyncs the staging directory, renames it to `v{version}`,
fsyncs the root, and only then writes `LATEST` under a temporary name, fsyncs it and renames it
over the old pointer. A `v{version}` directory therefore never exists half-written, and a version
is *published* exactly when the pointer names it (or a later version): a crash at any point before
the pointer moves leaves the previous version current; a directory the pointer does not cover yet
(a crash between the rename and the pointer) is replaced by the next publish of that version.
After the pointer moves, versions older than the newest `keep` are pruned: each is first renamed
to `.gone-*` (atomic, so a reader sees it either whole or absent) and then deleted.

Loading (any number of processes and threads) reads the manifest, checks that each data file ends
where its last array does, then reads every array and checks its crc32. A manifest's file names
must be plain names inside the version folder (no absolute path, no `..`, no separator; a symbolic
link is not followed). A version that was pruned, is being pruned, or was never published raises
`VersionGone`; a file whose bytes do not match its manifest raises `CorruptWeights`.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pathlib
import shutil
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Mapping

import numpy as np

from headrace.config import WeightsConfig
from headrace.rundir import RunDir
from headrace.weights.base import Params, VersionGone, WeightStore
from headrace.weights.format import (
    CorruptWeights,
    as_host_array,
    check_params,
    check_version,
    parse_record,
)
from headrace.weights.memory import MemoryWeightStore

POINTER = "LATEST"
PICKUPS = "pickups"  # one file per version: when an actor first sampled with it
MANIFEST = "manifest.json"
DATA = "arrays.bin"  # every array of a version, each at an offset that is a multiple of ALIGN
ALIGN = 64
# Manifest formats this store reads: 1, one file per array (versions written before DATA); 2,
# every array in DATA at its `offset`. It writes the last.
FORMATS = (1, 2)
_STAGING_PREFIX = ".tmp-"
_TRASH_PREFIX = ".gone-"



def _check_file_name(directory: pathlib.Path, file: object, name: str) -> None:
    """Refuses a manifest's file name that could reach outside its version folder: not a plain,
    single path component (absolute, `..`, `.`, a separator, a NUL byte, empty).

    Raises:
      CorruptWeights: the name, the parameter and the manifest it came from.
    """
    plain = (isinstance(file, str) and file not in ("", ".", "..") and "/" not in file
             and "\\" not in file and "\0" not in file and not os.path.isabs(file))
    if not plain:
        raise CorruptWeights(f"{directory / MANIFEST}: parameter {name!r} names the file "
                             f"{file!r}, which is not a plain file name inside {directory} "
                             "(absolute paths, '..' and separators are refused); the manifest "
                             "is forged or corrupt: republish the version")


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: pathlib.Path, data, fsync: bool) -> None:
    """Writes `data` (bytes-like) to a new file `path`; with `fsync`, durably."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def _open_data(directory: pathlib.Path, version: int, file: str, end: int) -> int:
    """An open descriptor of data file `file`, which must end where its last array does.

    Raises:
      CorruptWeights: a symbolic link (not followed), or a file of another size.
    """
    try:  # O_NOFOLLOW: a symbolic link planted in the version folder is not followed out
        fd = os.open(directory / file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise CorruptWeights(f"weights version {version}: {directory / file} is a symbolic "
                             "link; republish the version") from None
    size = os.fstat(fd).st_size
    if size != end:
        os.close(fd)
        raise CorruptWeights(f"weights version {version}: {directory / file} is {size} bytes "
                             f"long, its manifest's arrays end at byte {end}; republish the "
                             "version")
    return fd


@dataclasses.dataclass(frozen=True)
class _Record:
    """One array of a manifest: where its bytes are and what they must be."""

    path: str
    file: str
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int
    crc32: int

    @classmethod
    def parse(cls, directory: pathlib.Path, record: object) -> _Record:
        """Raises CorruptWeights for a record that is malformed (`format.parse_record`), names a
        file outside the version folder, or has a negative offset."""
        path, dtype, shape, nbytes, crc = parse_record(record, str(directory / MANIFEST))
        try:
            file, offset = record["file"], int(record.get("offset", 0))  # format 1: no offset
        except (KeyError, TypeError, ValueError):
            file, offset = None, -1
        if offset < 0:
            raise CorruptWeights(f"{directory / MANIFEST} has a malformed array record "
                                 f"{str(record)[:120]}; republish the version")
        _check_file_name(directory, file, path)
        return cls(path, file, offset, dtype, shape, nbytes, crc)

    def read(self, fd: int, directory: pathlib.Path, version: int) -> np.ndarray:
        """The array from open data file `fd`, its crc32 checked.

        Raises:
          CorruptWeights: the bytes are short or fail the checksum.
        """
        array = np.empty(self.shape, self.dtype)
        flat = memoryview(array.reshape(-1).view(np.uint8))
        done = 0
        while done < self.nbytes:  # one read moves at most ~2 GiB on Linux
            read = os.preadv(fd, [flat[done:]], self.offset + done)
            if read == 0:
                raise CorruptWeights(f"weights version {version}: {directory / self.file} "
                                     f"(parameter {self.path!r}) ends before its {self.nbytes} "
                                     "bytes; republish the version")
            done += read
        actual = zlib.crc32(flat)
        if actual != self.crc32:
            raise CorruptWeights(f"weights version {version}: {directory / self.file} (parameter "
                                 f"{self.path!r}) has crc32 {actual:08x}, the manifest says "
                                 f"{self.crc32:08x}; the file is corrupt: republish the version "
                                 "or load another")
        return array


class DirWeightStore(WeightStore):
    """Weight store backed by a directory; safe for one publisher and many concurrent readers.

    Args:
      root: the store's directory (created if missing).
      keep: versions kept after each publish (>= 1); older ones are pruned.
      fsync: fsync files and directories while publishing (turn off only for throwaway stores:
        without it a machine crash can leave a published version with missing bytes).

    Attributes (timings for `weights/publish_s` and `weights/pickup_s`; written by the calling
    thread, so with several loading threads they describe the most recent call):
      last_publish_s, last_publish_bytes: wall time and payload of the last `publish`.
      last_load_s, last_load_bytes: wall time and payload of the last successful `load`.

    Raises:
      ValueError: `keep` < 1.
      OSError: the directory cannot be created.
    """

    def __init__(self, root: str | os.PathLike, keep: int = 2, *, fsync: bool = True):
        if keep < 1:
            raise ValueError(f"keep={keep}: must be >= 1")
        self.root = pathlib.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._fsync = fsync
        self._publish_lock = threading.Lock()
        self.last_publish_s = float("nan")
        self.last_publish_bytes = 0
        self.last_load_s = float("nan")
        self.last_load_bytes = 0

    def __repr__(self) -> str:
        return f"DirWeightStore({str(self.root)!r}, keep={self.keep})"

    def version_dir(self, version: int) -> pathlib.Path:
        return self.root / f"v{version}"

    # --- pickups (tracing) ----------------------------------------------------------------------

    def note_pickup(self, version: int, at: float) -> None:
        """Creates `pickups/<version>` holding `at` unless an actor already did (first one wins)."""
        folder = self.root / PICKUPS
        folder.mkdir(exist_ok=True)
        try:
            fd = os.open(folder / str(version), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as file:
            file.write(repr(at))

    def pickup_time(self, version: int) -> float | None:
        try:
            text = (self.root / PICKUPS / str(version)).read_text()
            return float(text) if text else None  # empty: the writer is between open and write
        except (FileNotFoundError, ValueError):
            return None

    # --- reading -------------------------------------------------------------------------------

    def latest_version(self) -> int:
        """The version `LATEST` names, or -1 before the first publish (one small file read).

        Raises:
          CorruptWeights: the pointer file does not hold a version number.
        """
        try:
            text = (self.root / POINTER).read_text()
        except FileNotFoundError:
            return -1
        try:
            return int(text.strip())
        except ValueError:
            raise CorruptWeights(f"{self.root / POINTER} holds {text[:40]!r}, not a version "
                                 "number; delete it to start the store afresh") from None

    def versions(self) -> list[int]:
        """Published versions still on disk, oldest first."""
        latest = self.latest_version()
        found = []
        for entry in self.root.iterdir():
            name = entry.name
            if name.startswith("v") and name[1:].isdigit() and int(name[1:]) <= latest:
                found.append(int(name[1:]))
        return sorted(found)

    def load(self, version: int) -> Params:
        """Reads and verifies `version`; the arrays are fresh, writable copies.

        Raises:
          VersionGone: `version` was pruned (also while this call was reading it), or has not
            been published.
          CorruptWeights: the manifest is unreadable, or an array file is missing, has the wrong
            size, or fails its checksum (the message names the file and the parameter).
        """
        start = time.perf_counter()
        latest = self.latest_version()
        if not 0 <= version <= latest:
            raise VersionGone(f"weights version {version} is not published in {self.root} "
                              f"(latest: {latest})")
        directory = self.version_dir(version)
        files: dict[str, int] = {}  # data file name -> open descriptor
        try:
            manifest = self._read_manifest(directory, version)
            records = [_Record.parse(directory, record) for record in manifest["arrays"]]
            ends: dict[str, int] = {}
            for record in records:
                ends[record.file] = max(ends.get(record.file, 0), record.offset + record.nbytes)
            for file, end in ends.items():
                files[file] = _open_data(directory, version, file, end)
            params: Params = {r.path: r.read(files[r.file], directory, version) for r in records}
        except FileNotFoundError as error:
            if directory.is_dir():
                raise CorruptWeights(f"weights version {version}: {error.filename} is missing "
                                     f"from {directory}; republish the version") from None
            raise VersionGone(f"weights version {version} was pruned from {self.root} "
                              f"(kept: {self.versions()})") from None
        finally:
            for fd in files.values():
                os.close(fd)
        self.last_load_s = time.perf_counter() - start
        self.last_load_bytes = sum(r.nbytes for r in records)
        return params

    def _read_manifest(self, directory: pathlib.Path, version: int) -> dict:
        path = directory / MANIFEST
        raw = path.read_bytes()
        try:
            manifest = json.loads(raw)
            ok = (manifest["format"] in FORMATS and manifest["version"] == version
                  and isinstance(manifest["arrays"], list))
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise CorruptWeights(f"{path} is not a format-{FORMATS} manifest of version "
                                 f"{version}; republish the version")
        if manifest.get("byteorder", "little") != sys.byteorder:
            raise CorruptWeights(f"{path} was written on a {manifest['byteorder']}-endian host; "
                                 f"this host is {sys.byteorder}-endian")
        return manifest

    # --- writing -------------------------------------------------------------------------------

    def publish(self, params: Mapping[str, np.ndarray], version: int) -> None:
        """Writes `params` as `version`, moves `LATEST` to it, then prunes old versions.

        Blocks for the whole write (about one pass over the bytes plus the fsyncs). `params` may
        hold jax arrays; they are copied to the host first.

        Raises:
          ValueError: `version` is not an int newer than the latest, `params` is empty, a key is
            not a non-empty string, or an array has an unsupported dtype.
          OSError: the filesystem failed; the previous version stays current.
        """
        start = time.perf_counter()
        version = check_version(version)
        check_params(params)
        arrays = [(path, as_host_array(path, value)) for path, value in params.items()]
        with self._publish_lock:
            latest = self.latest_version()
            if version <= latest:
                raise ValueError(f"version {version} is not newer than {latest} in {self.root}")
            self._remove_leftovers()
            staging = self.root / f"{_STAGING_PREFIX}v{version}-{uuid.uuid4().hex[:8]}"
            staging.mkdir()
            try:
                total = self._write_version(staging, version, arrays)
                final = self.version_dir(version)
                if final.exists():  # left by a crash before the pointer moved: never published
                    self._discard(final)
                os.rename(staging, final)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            if self._fsync:
                _fsync_dir(self.root)
            self._write_pointer(version)
            self._prune()
        self.last_publish_s = time.perf_counter() - start
        self.last_publish_bytes = total

    def _write_version(self, staging: pathlib.Path, version: int,
                       arrays: list[tuple[str, np.ndarray]]) -> int:
        records = []
        end = 0
        with open(staging / DATA, "xb") as f:  # one file, not one per array: a publish costs a
            for path, array in arrays:          # few syscalls whatever the parameter count
                data = array.reshape(-1).view(np.uint8)
                offset = -(-end // ALIGN) * ALIGN
                f.write(bytes(offset - end))
                f.write(data)
                records.append({"path": path, "file": DATA, "offset": offset,
                                "dtype": array.dtype.name, "shape": list(array.shape),
                                "nbytes": int(array.nbytes), "crc32": zlib.crc32(data)})
                end = offset + array.nbytes
            f.flush()
            if self._fsync:
                os.fsync(f.fileno())
        total = sum(record["nbytes"] for record in records)
        manifest = {"format": FORMATS[-1], "version": version, "created": time.time(),
                    "byteorder": sys.byteorder, "total_bytes": total, "arrays": records}
        _write_file(staging / MANIFEST, json.dumps(manifest, indent=1).encode(), self._fsync)
        if self._fsync:
            _fsync_dir(staging)
        return total

    def _write_pointer(self, version: int) -> None:
        temporary = self.root / f"{_STAGING_PREFIX}{POINTER}-{uuid.uuid4().hex[:8]}"
        try:
            _write_file(temporary, f"{version}\n".encode(), self._fsync)
            os.replace(temporary, self.root / POINTER)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        if self._fsync:
            _fsync_dir(self.root)

    def _prune(self) -> None:
        """Removes published versions older than the newest `keep`, and their pickup notes."""
        kept = self.versions()
        for version in kept[:-self.keep]:
            self._discard(self.version_dir(version))
        folder = self.root / PICKUPS
        if folder.is_dir() and kept:
            oldest = kept[-self.keep:][0]
            for entry in folder.iterdir():
                if entry.name.isdigit() and int(entry.name) < oldest - 64:  # late readers' slack
                    entry.unlink(missing_ok=True)

    def _discard(self, directory: pathlib.Path) -> None:
        # Rename first: a reader then finds the version whole or not at all (VersionGone).
        trash = self.root / f"{_TRASH_PREFIX}{directory.name}-{uuid.uuid4().hex[:8]}"
        os.rename(directory, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _remove_leftovers(self) -> None:
        """Deletes staging and trash directories a crashed publisher left behind."""
        for entry in self.root.iterdir():
            if entry.name.startswith((_STAGING_PREFIX, _TRASH_PREFIX)):
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)


def from_config(config: WeightsConfig, run_dir: str | os.PathLike, keep: int) -> WeightStore:
    """The weight store a run's config asks for.

    Args:
      config: the `weights` section; `path` defaults to RUN_DIR/weights for the dir backend.
      run_dir: the run folder.
      keep: versions to keep, normally `Config.weights_keep` (max_policy_lag + 2 at least).

    The memory backend lives in one process: use it only with the threads launcher.
    """
    if config.backend == "memory":
        return MemoryWeightStore(keep=keep)
    if config.backend == "dir":
        return DirWeightStore(config.path or pathlib.Path(run_dir) / RunDir.WEIGHTS, keep=keep)
    if config.backend == "redis" and config.url:  # the run's own server: build.make_weights
        from headrace.weights.redis_store import RedisWeightStore, chunk_bytes_for

        return RedisWeightStore(config.url, pathlib.Path(run_dir).name, keep=keep,
                                chunk_bytes=chunk_bytes_for(config.chunk_mib))
    raise ValueError(f"weights.backend={config.backend!r}: one of dir, memory, or redis with "
                     "weights.url")
