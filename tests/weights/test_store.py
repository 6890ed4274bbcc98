"""The weight store contract (one suite over all backends) and the directory store's guarantees."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
import zlib

import ml_dtypes
import numpy as np
import pytest

from headrace.config import WeightsConfig
from headrace.weights import (
    CorruptWeights,
    DirWeightStore,
    MemoryWeightStore,
    VersionGone,
    WeightStore,
    from_config,
)
from headrace.weights.directory import MANIFEST, POINTER
from headrace.weights.redis_store import RedisWeightStore


def make_params(version: int = 0, scale: int = 1) -> dict[str, np.ndarray]:
    """Small parameters of every supported kind whose values identify `version`."""
    rng = np.random.default_rng(version)
    return {
        "embed.table": rng.standard_normal((16 * scale, 8)).astype(np.float32),
        "layers.0.attn.q.kernel": rng.standard_normal((8, 8)).astype(ml_dtypes.bfloat16),
        "layers.0.norm.scale": np.full((8,), version, np.float32),
        "step": np.asarray(version, np.int32),  # 0-d
        "empty": np.zeros((0, 3), np.float32),
    }


def assert_same(loaded: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert list(loaded) == list(expected)
    for name, array in expected.items():
        assert loaded[name].dtype == array.dtype, name
        assert loaded[name].shape == array.shape, name
        # Bit-exact, also for bfloat16 (compare the raw bytes).
        assert loaded[name].tobytes() == np.ascontiguousarray(array).tobytes(), name


def _opener(kind: str, tmp_path, request):
    """`open(name, keep)`: a store of `kind` named `name`; the same name reaches the same
    versions (another reader of one store), as a second process would."""
    if kind == "redis":
        server = request.getfixturevalue("redis_server")
        prefix = uuid.uuid4().hex[:12]  # tests share the session's server
        return lambda name, keep: RedisWeightStore(server.url, f"{prefix}-{name}", keep=keep,
                                                   chunk_bytes=64)  # several chunks per array
    return lambda name, keep: DirWeightStore(tmp_path / name, keep=keep)


@pytest.fixture(params=["memory", "dir", "redis"])
def make_store(request, tmp_path):
    stores = []
    opener = None if request.param == "memory" else _opener(request.param, tmp_path, request)

    def make(keep: int = 2) -> WeightStore:
        if opener is None:
            store = MemoryWeightStore(keep=keep)
        else:
            store = opener(f"store{len(stores)}", keep)
        stores.append(store)
        return store

    try:
        yield make
    finally:
        for store in stores:
            store.close()


@pytest.fixture(params=["dir", "redis"])
def open_durable(request, tmp_path):
    """`(open(name, keep), kind)` for the stores that other processes read."""
    opened = []
    opener = _opener(request.param, tmp_path, request)

    def make(name: str, keep: int = 2) -> WeightStore:
        opened.append(opener(name, keep))
        return opened[-1]

    try:
        yield make, request.param
    finally:
        for store in opened:
            store.close()


# --- the contract: every backend ---------------------------------------------------------------


def test_empty_store_has_version_minus_one(make_store):
    store = make_store()
    assert store.latest_version() == -1
    with pytest.raises(VersionGone):
        store.load(0)


def test_round_trip_is_exact(make_store):
    store = make_store()
    params = make_params(0)
    store.publish(params, 0)
    assert store.latest_version() == 0
    assert_same(store.load(0), params)


def test_versions_must_increase(make_store):
    store = make_store()
    store.publish(make_params(3), 3)
    for stale in (3, 2, -1):
        with pytest.raises(ValueError):
            store.publish(make_params(stale), stale)
    assert store.latest_version() == 3
    store.publish(make_params(7), 7)  # gaps are allowed
    assert store.latest_version() == 7
    assert_same(store.load(7), make_params(7))


def test_pruning_keeps_the_newest_n(make_store):
    store = make_store(keep=3)
    for version in range(6):
        store.publish(make_params(version), version)
        assert store.latest_version() == version
    for version in (3, 4, 5):
        assert_same(store.load(version), make_params(version))
    for version in (0, 1, 2):
        with pytest.raises(VersionGone):
            store.load(version)
    with pytest.raises(KeyError):  # VersionGone is a KeyError
        store.load(0)


def test_unpublished_version_is_gone(make_store):
    store = make_store()
    store.publish(make_params(0), 0)
    for version in (1, 10, -1):
        with pytest.raises(VersionGone):
            store.load(version)


def test_from_config_builds_each_backend(tmp_path):
    memory = from_config(WeightsConfig(backend="memory"), tmp_path, keep=3)
    assert isinstance(memory, MemoryWeightStore)
    default = from_config(WeightsConfig(backend="dir"), tmp_path, keep=3)
    assert isinstance(default, DirWeightStore)
    assert default.root == tmp_path / "weights" and default.keep == 3
    custom = from_config(WeightsConfig(backend="dir", path=str(tmp_path / "w")), tmp_path, keep=4)
    assert custom.root == tmp_path / "w" and custom.root.is_dir()


# --- the directory backend ---------------------------------------------------------------------


def test_layout_manifest_and_pointer(tmp_path):
    store = DirWeightStore(tmp_path, keep=2)
    params = make_params(4)
    store.publish(params, 4)
    assert (tmp_path / POINTER).read_text().strip() == "4"
    manifest = json.loads((tmp_path / "v4" / MANIFEST).read_text())
    assert manifest["version"] == 4 and manifest["created"] <= time.time()
    assert [r["path"] for r in manifest["arrays"]] == list(params)
    records = {r["path"]: r for r in manifest["arrays"]}
    assert records["layers.0.attn.q.kernel"]["dtype"] == "bfloat16"
    assert records["step"]["shape"] == [] and records["embed.table"]["shape"] == [16, 8]
    # Every array in one data file, at offsets aligned to 64 bytes, back to back, the file ending
    # where the last one does: a publish writes two files whatever the parameter count.
    assert manifest["format"] == 2 and sorted(p.name for p in (tmp_path / "v4").iterdir()) == [
        "arrays.bin", MANIFEST]
    data, end = (tmp_path / "v4" / "arrays.bin").read_bytes(), 0
    for record, array in zip(manifest["arrays"], params.values()):
        assert record["file"] == "arrays.bin" and record["offset"] % 64 == 0
        assert end <= record["offset"] < end + 64
        end = record["offset"] + record["nbytes"]
        assert data[record["offset"]:end] == np.ascontiguousarray(array).tobytes()
    assert len(data) == end
    # Nothing temporary is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == [POINTER, "v4"]


def test_versions_of_the_first_format_still_load(tmp_path):
    """Run folders written before the one data file (format 1: a file per array, no offsets)
    still load: evaluation and export of an older run read them."""
    params = make_params(3)
    (tmp_path / "v3").mkdir()
    records = []
    for index, (path, array) in enumerate(params.items()):
        data = np.ascontiguousarray(array).tobytes()
        (tmp_path / "v3" / f"{index:05d}.bin").write_bytes(data)
        records.append({"path": path, "file": f"{index:05d}.bin", "dtype": array.dtype.name,
                        "shape": list(array.shape), "nbytes": len(data),
                        "crc32": zlib.crc32(data)})
    (tmp_path / "v3" / MANIFEST).write_text(json.dumps(
        {"format": 1, "version": 3, "created": 0.0, "byteorder": sys.byteorder,
         "arrays": records}))
    (tmp_path / POINTER).write_text("3\n")
    assert_same(DirWeightStore(tmp_path).load(3), params)
    (tmp_path / "v3" / "00001.bin").write_bytes(b"\0" * 3)  # still checked file by file
    with pytest.raises(CorruptWeights, match="00001.bin is 3 bytes long"):
        DirWeightStore(tmp_path).load(3)


def test_timings_are_recorded(tmp_path):
    store = DirWeightStore(tmp_path)
    store.publish(make_params(0), 0)
    store.load(0)
    assert store.last_publish_s > 0 and store.last_load_s > 0
    assert store.last_publish_bytes == store.last_load_bytes == sum(
        a.nbytes for a in make_params(0).values())


def test_bfloat16_and_non_contiguous_round_trip(tmp_path):
    store = DirWeightStore(tmp_path)
    base = np.linspace(-3, 3, 48, dtype=np.float32).reshape(6, 8)
    params = {"bf16": base.astype(ml_dtypes.bfloat16), "transposed": base.T,
              "big_endian": base.astype(">f4"), "ints": np.arange(-5, 5, dtype=np.int32)}
    store.publish(params, 0)
    loaded = store.load(0)
    assert loaded["bf16"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert loaded["bf16"].view(np.uint16).tolist() == params["bf16"].view(np.uint16).tolist()
    np.testing.assert_array_equal(loaded["transposed"], base.T)
    np.testing.assert_array_equal(loaded["big_endian"], base)
    np.testing.assert_array_equal(loaded["ints"], params["ints"])
    loaded["ints"][0] = 99  # loads are private, writable copies
    assert store.load(0)["ints"][0] == -5


def test_bad_params_are_refused(tmp_path):
    store = DirWeightStore(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        store.publish({"names": np.array(["a", "b"])}, 0)
    with pytest.raises(ValueError, match="non-empty"):
        store.publish({}, 0)
    with pytest.raises(ValueError, match="string"):
        store.publish({3: np.zeros(2, np.float32)}, 0)
    with pytest.raises(ValueError, match="int"):
        store.publish(make_params(0), 1.5)
    with pytest.raises(ValueError, match="keep"):
        DirWeightStore(tmp_path, keep=0)
    assert store.latest_version() == -1
    assert list(tmp_path.iterdir()) == []


def test_crash_before_pointer_leaves_previous_version(tmp_path):
    store = DirWeightStore(tmp_path)
    store.publish(make_params(0), 0)
    # A publisher that died while writing v1: a partial version directory and a staging directory.
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "00000.bin").write_bytes(b"\0" * 10)
    (tmp_path / ".tmp-v1-deadbeef").mkdir()
    reader = DirWeightStore(tmp_path)
    assert reader.latest_version() == 0
    assert reader.versions() == [0]
    with pytest.raises(VersionGone):
        reader.load(1)
    assert_same(reader.load(0), make_params(0))
    # The restarted publisher writes v1 over the leftovers.
    store.publish(make_params(1), 1)
    assert_same(reader.load(1), make_params(1))
    assert not (tmp_path / ".tmp-v1-deadbeef").exists()


def test_pointer_is_written_last(tmp_path, monkeypatch):
    store = DirWeightStore(tmp_path)
    store.publish(make_params(0), 0)

    def crash(version):
        # Everything else of the version is on disk when the pointer is about to move.
        manifest = json.loads((tmp_path / f"v{version}" / MANIFEST).read_text())
        for record in manifest["arrays"]:
            assert (tmp_path / f"v{version}" / record["file"]).is_file()
        raise OSError("simulated crash before the pointer moved")

    monkeypatch.setattr(store, "_write_pointer", crash)
    with pytest.raises(OSError, match="simulated"):
        store.publish(make_params(1), 1)
    assert DirWeightStore(tmp_path).latest_version() == 0
    with pytest.raises(VersionGone):
        store.load(1)
    monkeypatch.undo()
    store.publish(make_params(1), 1)
    assert_same(store.load(1), make_params(1))


def test_corruption_is_detected(tmp_path):
    store = DirWeightStore(tmp_path, keep=3)
    store.publish(make_params(0), 0)
    manifest = json.loads((tmp_path / "v0" / MANIFEST).read_text())
    record = next(r for r in manifest["arrays"] if r["path"] == "embed.table")
    path = tmp_path / "v0" / record["file"]
    data = bytearray(path.read_bytes())
    data[17] ^= 0x01  # one flipped bit, same size
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptWeights, match="embed.table.*crc32"):
        store.load(0)
    path.write_bytes(bytes(data[:-4]))  # truncated
    with pytest.raises(CorruptWeights, match="bytes long"):
        store.load(0)
    path.unlink()  # missing while the version directory exists
    with pytest.raises(CorruptWeights, match="missing"):
        store.load(0)

    store.publish(make_params(1), 1)
    (tmp_path / "v1" / MANIFEST).write_text("{not json")
    with pytest.raises(CorruptWeights, match="manifest"):
        store.load(1)
    (tmp_path / POINTER).write_text("garbage")
    with pytest.raises(CorruptWeights, match="LATEST"):
        store.latest_version()


@pytest.mark.parametrize("forged", ["ABSOLUTE", "../../secret.bin", "../secret.bin",
                                    "sub/../../secret.bin", "..", ".", "", "a\\b", 7])
def test_forged_manifest_file_names_are_refused(tmp_path, forged):
    """A manifest naming a file outside its version folder is refused before anything is read,
    even when that file has exactly the size and checksum the manifest claims."""
    store_root = tmp_path / "store"
    store = DirWeightStore(store_root, keep=3)
    store.publish(make_params(0), 0)
    secret = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    outside = tmp_path / "secret.bin"
    outside.write_bytes(secret.tobytes())
    manifest_path = store_root / "v0" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    record = next(r for r in manifest["arrays"] if r["path"] == "embed.table")
    record["file"] = str(outside) if forged == "ABSOLUTE" else forged
    record["crc32"] = zlib.crc32(secret.tobytes())
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CorruptWeights, match="embed.table.*not a plain file name"):
        store.load(0)


def test_a_symbolic_link_in_a_version_folder_is_not_followed(tmp_path):
    store = DirWeightStore(tmp_path / "store", keep=3)
    store.publish(make_params(0), 0)
    manifest = json.loads((tmp_path / "store" / "v0" / MANIFEST).read_text())
    record = next(r for r in manifest["arrays"] if r["path"] == "embed.table")
    target = tmp_path / "store" / "v0" / record["file"]
    outside = tmp_path / "outside.bin"
    outside.write_bytes(target.read_bytes())  # the same bytes: only the link itself is wrong
    target.unlink()
    target.symlink_to(outside)
    with pytest.raises(CorruptWeights, match="symbolic link"):
        store.load(0)


@pytest.mark.timeout(120)  # above the 30 s wait for the readers plus their 30 s joins
def test_concurrent_reader_never_sees_a_partial_version(open_durable):
    opener, _ = open_durable
    writer = opener("shared", keep=2)
    reader = opener("shared", keep=2)
    writer.publish(make_params(0, scale=8), 0)
    stop = threading.Event()
    seen: list[list[int]] = [[], []]
    gone = [0]
    errors: list[BaseException] = []

    def read(seen_here: list[int]):
        try:
            while not stop.is_set():
                version = reader.latest_version()
                try:
                    loaded = reader.load(version)
                except VersionGone:
                    # Allowed only when pruned between the poll and the read.
                    assert reader.latest_version() >= version + writer.keep, version
                    gone[0] += 1
                    continue
                assert_same(loaded, make_params(version, scale=8))
                seen_here.append(version)
        except BaseException as error:  # surfaced in the main thread
            errors.append(error)

    threads = [threading.Thread(target=read, args=(s,), daemon=True) for s in seen]
    for thread in threads:
        thread.start()
    try:
        for version in range(1, 51):
            writer.publish(make_params(version, scale=8), version)
        # Fast publishes can all end before a slow (loaded) reader has finished one load: the
        # readers go on loading the last version, so wait until each has seen one.
        deadline = time.monotonic() + 30
        while not all(seen) and not errors and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert not errors, errors[0]
    for seen_here in seen:  # each reader saw complete versions, never going back
        assert seen_here and seen_here == sorted(seen_here), (seen_here, gone)
    assert max(max(s) for s in seen) >= 1, (seen, gone)
    assert writer.versions() == [49, 50]


@pytest.mark.timeout(60)
def test_another_process_reads_the_store(open_durable, tmp_path):
    opener, kind = open_durable
    store = opener("shared")
    store.publish(make_params(2), 2)
    if kind == "dir":
        open_code = ("from headrace.weights import DirWeightStore\n"
                     f"store = DirWeightStore({str(tmp_path / 'shared')!r})\n")
    else:
        open_code = ("from headrace.weights.redis_store import RedisWeightStore\n"
                     f"store = RedisWeightStore({store.url!r}, {store.namespace!r})\n")
    code = (
        "import sys, zlib\n" + open_code +
        "v = store.latest_version()\n"
        "params = store.load(v)\n"
        "print(v, zlib.crc32(b''.join(params[k].tobytes() for k in sorted(params))))\n"
        "assert 'jax' not in sys.modules, 'reading the store imported JAX'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                            text=True, timeout=50)
    assert result.returncode == 0, result.stderr[-2000:]
    expected = make_params(2)
    crc = zlib.crc32(b"".join(expected[k].tobytes() for k in sorted(expected)))
    assert result.stdout.split() == ["2", str(crc)]
