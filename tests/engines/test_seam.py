"""The engine seam without vLLM: config checks, per-token version stamps through BatchedPolicy
and EpisodeBuilder, WeightSync driving a store-loading engine, the JAX-free worker module, and
the server's errors when vLLM's environment is missing."""

import asyncio
import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from headrace.actor.policy import BatchedPolicy, WeightSync
from headrace.config import ConfigError, load
from headrace.engines.base import EngineError, StoreLoading
from headrace.engines.vllm_engine import VLLMEngine, VLLMSettings, _Flight
from headrace.engines.vllm_server import REPO, VLLMServer
from headrace.engines.vllm_worker import hf_tensors
from headrace.metrics.core import Metrics
from headrace.model.dims import ModelDims
from headrace.text.episode import EpisodeBuilder
from headrace.weights.base import VersionGone
from headrace.weights.memory import MemoryWeightStore


def test_engine_key_defaults_to_jax_and_vllm_needs_dir_store_and_untruncated_sampling():
    assert load(data={}).actor.engine == "jax"
    ok = load(data={"actor": {"engine": "vllm"}, "weights": {"backend": "dir"}})
    assert ok.actor.vllm.dtype == "float32" and ok.actor.vllm.threads == 1
    with pytest.raises(ConfigError, match="weights.backend"):
        load(data={"actor": {"engine": "vllm"}, "run": {"launcher": "threads"}})  # memory store
    with pytest.raises(ConfigError, match="top_k"):
        load(data={"actor": {"engine": "vllm"}, "weights": {"backend": "dir"},
                   "sampling": {"top_p": 0.9}})
    with pytest.raises(ConfigError, match="actor.vllm.url"):
        load(data={"actor": {"engine": "vllm", "vllm": {"url": "localhost:8000"}}})
    with pytest.raises(ConfigError, match="actor.engine"):
        load(data={"actor": {"engine": "sglang"}})


def test_flight_stamps_each_token_with_the_version_after_each_switch():
    flight = _Flight(version=3, tokens=list(range(7)))
    flight.switches += [(2, 4), (5, 6)]
    assert flight.versions().tolist() == [3, 3, 4, 4, 4, 6, 6]
    assert _Flight(version=1, tokens=[9, 9]).versions().tolist() == [1, 1]


def test_tokens_before_an_update_are_counted_by_the_runner_or_by_what_arrived():
    running = _Flight(0, tokens=[1, 2, 3])
    generated = {"cmpl-hrabc-0-1f2e3d4c": 5, "cmpl-hrother-0-00000000": 1}
    assert VLLMEngine._generated_before("hrabc", running, generated) == 5
    # not in the runner: finished (tokens arrived: all old) or not yet scheduled (none: all new)
    assert VLLMEngine._generated_before("hrdone", _Flight(0, tokens=[1]), generated) > 10**6
    assert VLLMEngine._generated_before("hrwait", _Flight(0), generated) == 0


class StampingEngine:
    """A store-loading engine whose calls return one version per token (as vLLM's may)."""

    episodes, compiles, inline_compiles = 0, 0, 0

    def __init__(self):
        self.version = -1
        self.loaded: list[int] = []

    def load_version(self, version):
        if version == 2:
            raise VersionGone("pruned")
        self.loaded.append(version)
        self.version = version

    def max_context(self):
        return 64

    def generate(self, contexts, greedy=False, slots=None):
        tokens = [np.arange(len(c), dtype=np.int32) for c in contexts]
        versions = [np.array([0] * (len(c) - 1) + [1], np.int32) for c in contexts]
        return tokens, [np.zeros(len(c), np.float32) for c in contexts], versions

    def precompile(self, greedy=False):
        return 0

    def close(self):
        pass


def test_per_token_versions_reach_the_episode_record():
    engine = StampingEngine()
    assert isinstance(engine, StoreLoading)

    async def turn():
        policy = BatchedPolicy(engine, Metrics(), max_batch=4, wait_s=0.001)
        server = asyncio.create_task(policy.serve())
        try:
            with policy.episode():
                return await asyncio.wait_for(policy.act(np.array([5, 6, 7], np.int32)), 10)
        finally:
            server.cancel()
            policy.close()

    tokens, logps, versions = asyncio.run(turn())
    builder = EpisodeBuilder()
    builder.add_observation([11, 12])
    builder.add_generated(tokens, logps, versions)
    builder.add_generated([4], [0.0], 2)
    assert builder.arrays()[3].tolist() == [-1, -1, 0, 0, 1, 2]
    assert builder.newest_version == 2
    before = [a.tolist() for a in builder.arrays()], [dataclasses.astuple(t) for t in builder.turns]
    with pytest.raises(ValueError, match="versions"):
        builder.add_generated([1, 2], [0.0, 0.0], [1])
    # refused whole: a turn or tokens half added would shift every later turn's span
    assert ([a.tolist() for a in builder.arrays()],
            [dataclasses.astuple(t) for t in builder.turns]) == before


def test_weight_sync_tells_a_store_loading_engine_the_version_and_falls_back_when_gone():
    store, engine = MemoryWeightStore(4), StampingEngine()
    sync = WeightSync(store, engine, Metrics())
    try:
        store.publish({"w": np.zeros(2, np.float32)}, 0)
        assert sync.refresh(force=True).result(10) and engine.loaded == [0]
        store.publish({"w": np.ones(2, np.float32)}, 1)
        sync.forced_lag = 0
        assert sync.refresh(force=True).result(10) and engine.version == 1
        store.publish({"w": np.ones(2, np.float32)}, 2)
        store.publish({"w": np.ones(2, np.float32)}, 3)
        sync.forced_lag = 1  # target 2 is "gone": the newest (3) is loaded instead
        assert sync.refresh(force=True).result(10) and engine.loaded == [0, 1, 3]
        assert store.pickup_time(3) is not None
    finally:
        sync.close()


def test_worker_module_imports_without_jax_or_torch():
    code = ("import sys, headrace.engines.vllm_worker, headrace.engines.vllm_engine; "
            "bad = [m for m in ('jax', 'torch', 'flax') if m in sys.modules]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-800:]


def test_worker_maps_store_names_to_hugging_face_names_as_export_does():
    from headrace.formats import hf
    from headrace.model import params as params_lib

    dims = ModelDims(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=24)
    flat = params_lib.to_host(params_lib.init(dims, 0)[1])
    pairs = dict(hf_tensors(flat, vars(dims)))
    assert set(pairs) == {name for name, _, _ in hf.name_table(vars(dims))}
    for name, ours, transposed in hf.name_table(vars(dims)):
        want = flat[ours].T if transposed else flat[ours]
        np.testing.assert_array_equal(pairs[name], want)
    with pytest.raises(KeyError, match="not this model"):
        hf_tensors({k: v for k, v in flat.items() if "embed" not in k}, vars(dims))


def test_a_missing_vllm_environment_is_a_clear_error(tmp_path):
    server = VLLMServer(tmp_path, tmp_path / "log", python=str(tmp_path / "no-python"))
    with pytest.raises(EngineError, match="scripts/vllm.sh setup"):
        server.start()


def test_a_server_that_exits_while_starting_is_an_error_with_its_log(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no module named vllm' >&2\nexit 3\n")
    fake.chmod(0o755)
    server = VLLMServer(tmp_path, tmp_path / "log", python=str(fake), start_timeout_s=30)
    with pytest.raises(EngineError, match="status 3(.|\n)*no module named vllm"):
        server.start()
    assert not server.alive()


def test_generate_refuses_too_long_contexts_before_any_request():
    engine = VLLMEngine(VLLMSettings(1.0, 4, (), 16), store_root="/nonexistent", spec={},
                        export=lambda v, out: None, workdir="/nonexistent", url="http://x")
    with pytest.raises(ValueError, match="max_model_len 16"):
        engine.generate([list(range(13))])


def test_the_server_folder_is_what_headrace_export_writes(tmp_path):
    import json

    from safetensors.numpy import load_file

    from headrace.engines.vllm_worker import export_version
    from headrace.model import params as params_lib
    from headrace.runtime.export import export_params
    from headrace.weights.directory import DirWeightStore

    dims = ModelDims(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=24)
    params = params_lib.init(dims, 0)[1]
    store = DirWeightStore(tmp_path / "weights", fsync=False)
    store.publish(params_lib.to_host(params), 0)
    ours = export_version(store, 0, vars(dims), tmp_path / "ours", max_len=64)
    reference = export_params(dims, params, tmp_path / "reference", max_len=64)
    assert json.loads((ours / "config.json").read_text()) == \
        json.loads((reference / "config.json").read_text())
    a, b = load_file(str(ours / "model.safetensors")), load_file(str(reference /
                                                                     "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_the_composition_root_builds_the_vllm_engine_lazily_and_refuses_what_it_cannot_serve(
        tmp_path):
    import json

    from headrace.model import params as params_lib
    from headrace.runtime import build
    from headrace.weights.directory import DirWeightStore

    data = {"actor": {"engine": "vllm"}, "weights": {"backend": "dir"},
            "sampling": {"constrain_to_actions": False, "max_new_tokens": 2},
            "model": {"max_len": 32}, "shapes": {"buckets": [16, 32]}}
    config = load(data=data)
    task = build.build_task(config)
    store = DirWeightStore(tmp_path / "weights", fsync=False)
    store.publish(params_lib.to_host(params_lib.init(task.dims, 0)[1]), 0)
    engine = build.actor_sampler(config, task, None, 3, store)
    assert isinstance(engine, VLLMEngine) and engine.server is None  # starts on first load
    assert engine.max_context() == 32 - 2
    assert engine.workdir == tmp_path / "vllm" / "actor-3"
    engine.export(0, tmp_path / "model")
    written = json.loads((tmp_path / "model" / "config.json").read_text())
    assert written["vocab_size"] == task.dims.vocab_size and written["dtype"] == "float32"
    with pytest.raises(ConfigError, match="directory weight store"):
        build.actor_sampler(config, task, None, 0, MemoryWeightStore(2))
    constrained = load(data={**data, "sampling": {"constrain_to_actions": True}})
    with pytest.raises(ConfigError, match="constrain_to_actions"):
        build.actor_sampler(constrained, build.build_task(constrained), None, 0, store)


def test_a_lora_run_serves_its_base_and_hands_each_version_over_as_a_peft_adapter(tmp_path):
    import json

    import jax
    from safetensors.numpy import load_file

    from headrace.model import lora
    from headrace.model import params as params_lib
    from headrace.runtime import build
    from headrace.runtime.export import export_adapter
    from headrace.weights.directory import DirWeightStore

    data = {"actor": {"engine": "vllm"}, "weights": {"backend": "dir"},
            "sampling": {"constrain_to_actions": False, "max_new_tokens": 2},
            "model": {"max_len": 32, "lora": {"rank": 4, "alpha": 8.0, "targets": ["q", "down"]}},
            "shapes": {"buckets": [32]}}
    config = load(data=data)
    task = build.build_task(config)
    base = build.init_params(config, task)[1]
    spec = lora.LoraSpec.of(config.model.lora)
    tree = jax.tree.map(lambda x: x + 0.5, lora.init(base, spec, 1))  # B away from zero
    store = DirWeightStore(tmp_path / "weights", fsync=False)
    store.publish(params_lib.to_host(tree), 0)
    engine = build.actor_sampler(config, task, None, 0, store)
    assert engine.adapter is not None and engine.server_options["lora_rank"] == 4
    engine.export(0, tmp_path / "vllm" / "actor-0" / "base")  # the base, as the server starts
    served = load_file(str(tmp_path / "vllm" / "actor-0" / "base" / "model.safetensors"))
    q = served["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(q, np.asarray(base["layers"][0]["attn"]["q"]["kernel"]).T)
    engine.adapter(0, tmp_path / "adapter")
    reference = export_adapter(task.dims, tree, spec, tmp_path / "reference",
                               str(tmp_path / "vllm" / "actor-0" / "base"))
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text()) == \
        json.loads((reference / "adapter_config.json").read_text())
    ours, theirs = (load_file(str(d / "adapter_model.safetensors"))
                    for d in (tmp_path / "adapter", reference))
    assert ours.keys() == theirs.keys() and len(ours) == 2 * 2 * task.dims.n_layers
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name])
    store.publish(params_lib.to_host(base), 1)  # full weights where adapters belong
    with pytest.raises(lora.AdapterError, match="full weights"):
        engine.adapter(1, tmp_path / "wrong")
    # vLLM accepts --max-lora-rank 1, 8, 16, ...: rank 4 is served as 8
    flags = VLLMServer(tmp_path, tmp_path / "log", lora_rank=4).command()
    assert flags[flags.index("--max-lora-rank") + 1] == "8" and "--enable-lora" in flags
    assert "--enable-lora" not in VLLMServer(tmp_path, tmp_path / "log").command()
    given = load(data={**data, "actor": {"engine": "vllm", "vllm": {"url": "http://x:1"}}})
    with pytest.raises(ConfigError, match="actor.vllm.url with model.lora"):
        build.actor_sampler(given, task, None, 0, store)
    wide = load(data={**data, "model": {**data["model"], "lora": {"rank": 1024}}})
    with pytest.raises(ConfigError, match="ranks? <= 512"):
        build.actor_sampler(wide, task, None, 0, store)


class FakeLoraServer:
    """Stands in for `VLLMEngine._call` against a LoRA server: records the adapter calls and
    answers as vLLM does (404 for an unknown name), or fails the ones it is told to."""

    def __init__(self):
        self.registered: set[str] = set()
        self.calls: list[tuple[str, dict]] = []
        self.fail: set[tuple[str, str]] = set()  # (path, adapter name): answer 500 / raise

    def __call__(self, method, path, *, check=True, **kwargs):
        import httpx

        body = kwargs.get("json") or {}
        self.calls.append((path, body))
        name = body.get("lora_name")
        if (path, name) in self.fail:
            if check:
                raise EngineError(f"{path} timed out")
            return httpx.Response(500, text="boom")
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "headrace"}]})
        if path == "/v1/load_lora_adapter":
            assert body["load_inplace"] is True  # a retry of a lost answer must not fail
            self.registered.add(name)
        elif path == "/v1/unload_lora_adapter":
            if name not in self.registered:
                return httpx.Response(404, text="not found")
            self.registered.discard(name)
        return httpx.Response(200, text="ok")


def test_lora_adapters_are_kept_while_named_and_cleaned_up_through_failures(tmp_path):
    def write(version, out):
        out.mkdir(parents=True)
        (out / "adapter_model.safetensors").write_bytes(b"x" * (version + 1))

    engine = VLLMEngine(VLLMSettings(1.0, 4, (), 64), store_root="/nonexistent", spec={},
                        export=None, adapter=write, lora_rank=8, workdir=tmp_path,
                        url="http://x")
    server = engine._call = FakeLoraServer()
    folders = lambda: {f.name for f in tmp_path.iterdir()}  # noqa: E731

    with pytest.raises(EngineError, match="before the first load_version"):
        engine.generate([[1, 2]])
    engine.load_version(0)
    engine._flights["a"] = _Flight(0)  # a request sent with v0, still generating
    engine.load_version(1)
    assert server.registered == {"v0", "v1"} and folders() == {"adapter-v0", "adapter-v1"}
    del engine._flights["a"]
    server.fail.add(("/v1/unload_lora_adapter", "v0"))
    engine.load_version(2)  # v0's unload fails: logged, kept for later; v2 installed anyway
    assert engine.version == 2 and engine._adapters == {0, 2}
    assert folders() == {"adapter-v0", "adapter-v2"}
    server.fail.clear()
    engine.load_version(3)
    assert server.registered == {"v3"} and folders() == {"adapter-v3"}
    # a registration whose answer is lost: not installed; a retry registers it in place
    server.fail.add(("/v1/load_lora_adapter", "v4"))
    with pytest.raises(EngineError, match="timed out"):
        engine.load_version(4)
    assert engine.version == 3 and engine._unconfirmed == {4}
    server.fail.clear()
    engine.load_version(4)
    assert engine.version == 4 and not engine._unconfirmed and server.registered == {"v4"}
    # one that is never retried is unloaded by the next update's clean-up (404: done)
    server.fail.add(("/v1/load_lora_adapter", "v5"))
    with pytest.raises(EngineError):
        engine.load_version(5)
    server.fail.clear()
    engine.load_version(6)
    assert ("/v1/unload_lora_adapter", {"lora_name": "v5"}) in server.calls
    assert engine._adapters == {6} and not engine._unconfirmed and folders() == {"adapter-v6"}
    with pytest.raises(ValueError, match="lora_rank"):
        VLLMEngine(VLLMSettings(1.0, 4, (), 64), store_root="/x", spec={}, export=None,
                   adapter=write, workdir=tmp_path)


def test_the_setup_command_runs_the_engine_tests_requiring_vllm(tmp_path):
    import os

    script = REPO / "scripts" / "vllm.sh"
    env = {**os.environ, "HEADRACE_DRY_RUN": "1", "HEADRACE_PYTHON": sys.executable}
    done = subprocess.run(["bash", str(script), "test", "-k", "stamps"], capture_output=True,
                          text=True, timeout=30, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (f"HEADRACE_REQUIRE_VLLM=1 {sys.executable} -m pytest -q "
                                   "tests/engines -k stamps")
    wrong = subprocess.run(["bash", str(script), "tset"], capture_output=True, text=True,
                           timeout=30, env=env)
    assert wrong.returncode == 2 and "usage" in wrong.stderr
