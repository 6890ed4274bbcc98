"""The composition root: every component of a run built from one Config.

Actor code and learner code never import each other; this module is where they meet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import pathlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp
import yaml

from headrace import config as config_lib
from headrace.actor.actor import Actor
from headrace.buffer.admission import Admission
from headrace.buffer.base import Buffer
from headrace.buffer.memory import MemoryBuffer
from headrace.config import Config, ConfigError
from headrace.env.base import Env
from headrace.env.registry import env_factory
from headrace.learner.loop import Learner
from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.model.lora import LoraSpec, Merger
from headrace.model.sampler import PromptTooLong, Sampler, SamplerSettings
from headrace.model.transformer import ModelDims
from headrace.rundir import RunDir
from headrace.text.template import make_tokenizer
from headrace.text.tokenizers import Tokenizer, WordTokenizer
from headrace.weights.base import WeightStore
from headrace.weights.memory import MemoryWeightStore


@dataclasses.dataclass
class Task:
    """What both sides need to know about the environment and its text."""

    make_env: Callable[[], Env]
    tokenizer: Tokenizer
    dims: ModelDims
    sampler_settings: SamplerSettings


def build_task(config: Config) -> Task:
    make_env = env_factory(config.env, config.run.seed)
    probe = make_env()
    spec = probe.spec
    probe.close()
    # carries the chat template; a checkpoint's own with model.init_from hf:/gguf:
    tokenizer = make_tokenizer(spec.vocabulary, config.text, config.model.init_from)
    dims = ModelDims.from_config(config.model, tokenizer.vocab_size)
    if dims.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={dims.vocab_size}: the tokenizer needs at least "
                          f"{tokenizer.vocab_size}")
    if config.model.init_from:  # fail here, in the supervisor, not in the learner process
        from headrace.sft import check_init_from

        check_init_from(config, dims)
    sampling = config.sampling
    allowed = None
    if sampling.constrain_to_actions and spec.action_words and isinstance(tokenizer, WordTokenizer):
        allowed = tokenizer.ids_of(spec.action_words)
    settings = SamplerSettings(temperature=sampling.temperature, top_k=sampling.top_k,
                               top_p=sampling.top_p, max_new_tokens=sampling.max_new_tokens,
                               stop_ids=tokenizer.stop_ids, pad_id=tokenizer.pad_id,
                               allowed_ids=allowed)
    return Task(make_env, tokenizer, dims, settings)


KEPT_CACHE_LIMIT_GIB = 8.0


def kept_episodes(config: Config, task: Task) -> int:
    """How many episodes an actor's sampler keeps caches for (`sampling.keep_cache`); launchers
    call it before starting actors, so a config that cannot fit fails once, at start.

    Raises:
      ConfigError: the kept caches would take more than KEPT_CACHE_LIMIT_GIB.
    """
    episodes = config.actor.envs_per_actor if config.sampling.keep_cache else 0
    d = task.dims
    gib = (episodes * config.shapes.buckets[-1] * d.n_layers * 2 * d.n_kv_heads * d.head_dim
           * jnp.dtype(d.dtype).itemsize / 2**30)
    if gib > KEPT_CACHE_LIMIT_GIB:
        raise ConfigError(f"sampling.keep_cache=true: {episodes} episodes x the largest bucket "
                          f"{config.shapes.buckets[-1]} need {gib:.1f} GiB of kept caches per "
                          f"actor (limit {KEPT_CACHE_LIMIT_GIB}); lower actor.envs_per_actor or "
                          "shapes.buckets, or set sampling.keep_cache: false")
    return episodes


def make_sampler(config: Config, task: Task, graphdef, seed: int, acting: bool = False,
                 background_compiles: bool | None = None) -> Sampler:
    """The policy's sampler. An actor's (`acting`) keeps caches as `kept_episodes` says and
    compiles new shapes in the background, so a compile never stalls its episodes (unless
    `background_compiles` says otherwise: a probe times calls, not stand-ins)."""
    return Sampler(graphdef, task.sampler_settings, task.dims.vocab_size, config.shapes.buckets,
                   config.actor.max_batch, seed=seed,
                   episodes=kept_episodes(config, task) if acting else 0,
                   background_compiles=acting if background_compiles is None
                   else background_compiles)


def init_params(config: Config, task: Task):
    """Fresh parameters, or those of the run folder `model.init_from` names (`headrace.sft`)."""
    if config.model.init_from:
        from headrace.sft import load_init_params

        return load_init_params(config, task.dims)
    return params_lib.init(task.dims, config.run.seed)


def weights_loader(config: Config, task: Task, base=None) -> Callable[[dict], Any]:
    """Published weights (flat NumPy) -> device params for a sampler: `params.from_host`, or with
    `model.lora` a `lora.Merger` that merges each version's adapters into the fixed base (the
    model's weights from `model.init_from` or the seed, loaded here once unless `base` is given).

    Raises:
      ConfigError: `model.init_from` does not load (as `init_params`).
    """
    spec = LoraSpec.of(config.model.lora)
    if spec is None:
        return params_lib.from_host
    if base is None:
        base = init_params(config, task)[1]
    return Merger(base, spec)


# --- the learner and the actors: every launcher, bench and test builds them here ----------------

def make_learner(config: Config, task: Task, graphdef, params, buffer: Buffer,
                 weights: WeightStore, metrics: Metrics, stop: threading.Event, *,
                 admission: Admission | None = None, checkpointer=None, ledger=None,
                 run_dir: str | pathlib.Path | None = None,
                 pins: WeightStore | None = None) -> Learner:
    """The learner of `task`'s model (its loss masked to the tokens the policy may emit).

    Args:
      checkpointer, ledger: see `Learner` (None: no checkpoints, no ledger).
      run_dir: the run folder its traces go to (`trace_path`); None: no traces.
      pins: where evaluation points' weights go (`make_pins`); None: no pins.

    Raises:
      ValueError: the checkpoint does not match this model and optimizer.
    """
    return Learner(config, graphdef, params, buffer, weights, metrics, stop,
                   allowed_v=task.sampler_settings.allowed_mask(task.dims.vocab_size),
                   admission=admission, checkpointer=checkpointer, ledger=ledger,
                   trace_path=None if run_dir is None else trace_path(config,
                                                                      pathlib.Path(run_dir)),
                   pins=pins)


def actor_sampler(config: Config, task: Task, graphdef, index: int,
                  weights: WeightStore | None = None):
    """The engine of actor `index`: with `actor.engine: jax` its sampler (its own seed; kept
    caches and background compiles), with `vllm` a `VLLMEngine` reading `weights` (the run's
    directory store), whose server starts when the first version is loaded."""
    if config.actor.engine == "vllm":
        return vllm_engine(config, task, index, weights)
    return make_sampler(config, task, graphdef, seed=config.run.seed + 100 + index, acting=True)


def vllm_engine(config: Config, task: Task, index: int, weights: WeightStore | None):
    """`actor.engine: vllm` (docs/engines.md): the engine, its server folder RUN_DIR/vllm/actor-i.

    Raises:
      ConfigError: the gateway, LoRA with a given server or a rank above 512, no directory
        weight store, or a constrained action
        vocabulary (vLLM would report log-probs of the constrained distribution, which the
        learner does not use).
    """
    from headrace.engines.vllm_engine import VLLMEngine, VLLMSettings
    from headrace.engines.vllm_server import LORA_RANKS
    from headrace.engines.vllm_worker import export_version
    from headrace.formats import checkpoint_kind
    from headrace.weights.directory import DirWeightStore

    if config.env.name == "gateway":
        raise ConfigError("actor.engine=vllm with env.name: gateway: the gateway records one "
                          "weights version per reply and serves top log-probs from the JAX "
                          "sampler; use actor.engine: jax there")
    spec_lora = LoraSpec.of(config.model.lora)
    if spec_lora is not None and spec_lora.rank > LORA_RANKS[-1]:
        raise ConfigError(f"model.lora.rank {spec_lora.rank} with actor.engine=vllm: vLLM serves "
                          f"adapters of rank <= {LORA_RANKS[-1]}; lower the rank")
    if spec_lora is not None and config.actor.vllm.url:
        raise ConfigError("actor.vllm.url with model.lora: the engine serves a LoRA run's "
                          "adapters on the base it exports itself; leave actor.vllm.url empty")
    if not isinstance(weights, DirWeightStore):
        raise ConfigError("actor.engine=vllm reads published versions from a directory weight "
                          f"store; this actor has {type(weights).__name__}: set weights.backend: "
                          "dir")
    settings = task.sampler_settings
    if settings.allowed_ids is not None:
        raise ConfigError("actor.engine=vllm with sampling.constrain_to_actions: vLLM reports the "
                          "constrained distribution's log-probs; use actor.engine: jax or set "
                          "sampling.constrain_to_actions: false")
    cfg = config.actor.vllm
    max_model_len = cfg.max_model_len or config.shapes.buckets[-1]
    family, extra = "llama", {}
    if checkpoint_kind(config.model.init_from):  # as `headrace export` names it
        from headrace.model.dims import open_checkpoint

        base = open_checkpoint(config.model.init_from)[2]
        family = base["model_type"]
        extra = {k: base[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                 if base.get(k) is not None}

    spec = dataclasses.asdict(task.dims)

    def export(version: int, out: pathlib.Path) -> None:
        export_version(weights, version, spec, out, family=family, dtype=cfg.dtype,
                       max_len=max_model_len, extra_config=extra)

    adapter = None
    if spec_lora is not None:
        # the base as the learner's: model.init_from or the seed
        export, adapter = vllm_lora_writers(task.dims, lambda: init_params(config, task)[1],
                                            spec_lora, weights, family=family, dtype=cfg.dtype,
                                            max_len=max_model_len, extra=extra)
    workdir = weights.root.parent / "vllm" / f"actor-{index}"
    return VLLMEngine(
        VLLMSettings(settings.temperature, settings.max_new_tokens, tuple(settings.stop_ids),
                     max_model_len),
        store_root=weights.root, spec=spec, export=export, adapter=adapter,
        lora_rank=config.model.lora.rank, workdir=workdir, url=cfg.url,
        request_timeout_s=cfg.request_timeout_s,
        server_options=dict(python=cfg.python, dtype=cfg.dtype, max_model_len=max_model_len,
                            kv_cache_gib=cfg.kv_cache_gib, threads=cfg.threads,
                            start_timeout_s=cfg.start_timeout_s),
        prompt_too_long=PromptTooLong)


def vllm_lora_writers(dims: ModelDims, base: Callable[[], Any], spec: LoraSpec, store, *,
                      family: str = "llama", dtype: str = "float32", max_len: int = 0,
                      extra: dict | None = None):
    """The (export, adapter) callables of a LoRA run's `VLLMEngine`: `export` writes the base
    (`base()`, built then) as the Hugging Face folder the server starts on; `adapter` writes a
    version's adapters from the directory store `store`, checked against the base's shapes, as a
    PEFT folder for that base."""
    from headrace.engines.vllm_worker import export_adapter_version, export_flat
    from headrace.model import lora

    base_dir: list[pathlib.Path] = []
    expected: dict[str, tuple[int, ...]] = {}

    def export(version: int, out: pathlib.Path) -> None:
        params = base()
        expected.update(lora.shapes(params, spec))
        export_flat(params_lib.to_host(params), dataclasses.asdict(dims), out, family=family,
                    dtype=dtype, max_len=max_len, extra_config=extra)
        base_dir.append(out)

    def adapter(version: int, out: pathlib.Path) -> None:
        export_adapter_version(store, version, dataclasses.asdict(dims), out, expected=expected,
                               rank=spec.rank, alpha=spec.alpha, targets=spec.targets,
                               base=str(base_dir[-1]), dtype=dtype)

    return export, adapter


def make_actor(config: Config, task: Task, name: str, sampler, buffer: Buffer,
               weights: WeightStore, metrics: Metrics, stop: threading.Event, *,
               admission: Admission | None = None) -> Actor:
    """An actor named `name` playing `task`'s environment with `sampler` (`actor_sampler`, or
    any object with the sampler's `generate`, `set_params` and `version`)."""
    return Actor(config, name, task.make_env, task.tokenizer, sampler, buffer, weights, metrics,
                 stop, admission,
                 loader=weights_loader(config, task)
                 if config.model.lora.rank and config.actor.engine == "jax" else None)


# --- the Redis password (docs/runtime.md, "Security") ----------------------------------------

PASSWORD_ENV = "HEADRACE_REDIS_PASSWORD"


def buffer_password(config: Config) -> str:
    """The Redis password clients use: `buffer.password`, else $HEADRACE_REDIS_PASSWORD (how the
    processes launcher hands it to its children: never in argv, never in a file)."""
    return config.buffer.password or os.environ.get(PASSWORD_ENV, "")


def without_secrets(config: Config) -> Config:
    """`config` with `buffer.password` blanked: what is written to files or sent to children."""
    return config_lib.replace(config, buffer={"password": ""}) if config.buffer.password \
        else config


def start_embedded_redis(config: Config, run_dir: pathlib.Path, *, resume: bool = False):
    """Starts the run's own redis-server when the buffer is Redis without `buffer.url`.

    The server gets random passwords kept in RUN_DIR/secrets.json (0600) and a restricted client
    user (`headrace.buffer.server`); a user-given password becomes the client's and is never
    stored. Returns (server or None, config): the config's `buffer.password` is then the one
    clients use; keep it in memory (`without_secrets` before writing it anywhere).

    Raises:
      RedisServerError: no binary, the server did not start, or a resumed run's passwords are
        missing (see `RedisCredentials.for_run`).
    """
    if config.buffer.backend != "redis" or config.buffer.url or config.buffer.urls:
        return None, config_lib.replace(config, buffer={"password": buffer_password(config)},
                                        weights=weights_server(config, config.buffer.url or (
                                            config.buffer.urls[0] if config.buffer.urls else "")))
    from headrace.buffer.server import RedisCredentials, RedisServer

    credentials = RedisCredentials.for_run(run_dir, buffer_password(config), resume=resume)
    server = RedisServer.for_run(config.buffer, run_dir / RunDir.REDIS, credentials,
                                 host=config.buffer.host, port=config.buffer.port).start()
    return server, config_lib.replace(config, buffer={"password": credentials.client},
                                      weights=weights_server(config, server.url))


def weights_server(config: Config, buffer_url: str) -> dict:
    """The redis weight store's server when `weights.url` is empty: the buffer's (shard 0's)."""
    if config.weights.backend == "redis" and not config.weights.url and buffer_url:
        return {"url": buffer_url}
    return {}


@contextlib.contextmanager
def password_for_children(config: Config) -> Iterator[None]:
    """Puts `buffer.password` in $HEADRACE_REDIS_PASSWORD while child processes are started
    (they inherit the environment); restores the variable afterwards."""
    previous = os.environ.get(PASSWORD_ENV)
    if config.buffer.password:
        os.environ[PASSWORD_ENV] = config.buffer.password
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(PASSWORD_ENV, None)
        else:
            os.environ[PASSWORD_ENV] = previous


def make_buffer(config: Config, *, url: str = "", run_id: str = "", consumer: str = "",
                host: int | None = None, hosts: int = 1) -> Buffer:
    """The configured buffer; the Redis backend needs the server's url (an embedded server's;
    `buffer.url`/`urls` win) and this run's id (and the password: `buffer_password`).

    With `buffer.shards` > 1 (or several `buffer.urls`) it is a `ShardedBuffer`: a learner host
    (`host` of `hosts`) reads its share of the shards; anyone else (an actor) writes to the shard
    its `consumer` name hashes to (and may read every shard).
    """
    b = config.buffer
    if b.backend == "memory":
        return MemoryBuffer(b.capacity, b.max_pending, b.claim_idle_s)
    from headrace.buffer.redis_stream import RedisBuffer

    b = dataclasses.replace(b, password=buffer_password(config))
    n = b.shard_count
    if n == 1:
        return RedisBuffer.from_config(b, b.shard_url(0, url), run_id, consumer)
    from headrace.buffer.redis_client import connect
    from headrace.buffer.sharded import ShardedBuffer, read_shards, shard_of

    shared = None if b.urls else connect(b.shard_url(0, url), b.password or None, 30.0)
    shards = [RedisBuffer(shared or b.shard_url(i, url), run_id=run_id, consumer=consumer,
                          capacity=b.capacity, max_pending=b.max_pending,
                          claim_idle_s=b.claim_idle_s, password=b.password or None, shard=i)
              for i in range(n)]
    if host is None:  # a writer (an actor); reading every shard, should it read
        return ShardedBuffer(shards, write=shard_of(consumer, n), read=range(n),
                             shared_client=shared)
    read = read_shards(host, hosts, n)
    if not read:
        raise ConfigError(f"buffer.shards={n}: fewer shards than the {hosts} learner hosts "
                          f"(host {host} would read none); use at least {hosts} shards")
    return ShardedBuffer(shards, read=read, shared_client=shared)


def make_admission(config: Config, buffer: Buffer, *, url: str = "", run_id: str = ""):
    """Admission control shared by the learner and every actor (in-process, or in Redis on shard
    0's server, counting every shard's stream)."""
    from headrace.buffer.admission import AdmissionLimits, InProcessAdmission

    limits = AdmissionLimits.from_config(config)
    b = config.buffer
    if not url:
        return InProcessAdmission(limits, counts=buffer.counts)
    from headrace.buffer.admission_redis import RedisAdmission

    remote = None
    if b.urls and len(b.urls) > 1:  # shards on other servers: their counts read before deciding
        others = buffer.shards[1:]

        def remote() -> tuple[int, int]:
            return (sum(s.depth() for s in others), sum(s.pending() for s in others))

    return RedisAdmission(b.shard_url(0, url), limits, run_id=run_id,
                          password=buffer_password(config) or None,
                          local_shards=1 if b.urls else b.shard_count, remote_counts=remote)


def make_weights(config: Config, run_dir: str | pathlib.Path | None = None) -> WeightStore:
    """The configured weight store. The redis backend's server is `weights.url` (which
    `start_embedded_redis` fills with the buffer's server when empty); its keys are namespaced
    by `weights.namespace`, else the run folder's name, so every process of a run finds the same
    versions."""
    if config.weights.backend == "memory":
        return MemoryWeightStore(config.weights_keep)
    if config.weights.backend == "redis":
        from urllib.parse import urlsplit

        from headrace.weights.redis_store import RedisWeightStore, chunk_bytes_for

        url = config.weights.url
        if not url:
            raise ConfigError("weights.backend=redis needs weights.url (a Redis server every "
                              "node reaches), or buffer.backend: redis, whose server it then "
                              "shares")
        password = None if urlsplit(url).password else (buffer_password(config) or None)
        namespace = config.weights.namespace or (
            pathlib.Path(run_dir).name if run_dir else "default")
        return RedisWeightStore(url, namespace, keep=config.weights_keep, password=password,
                                chunk_bytes=chunk_bytes_for(config.weights.chunk_mib))
    from headrace.weights.directory import DirWeightStore

    if run_dir is None and not config.weights.path:
        raise ConfigError("weights.backend='dir' needs weights.path or a run folder")
    path = config.weights.path or pathlib.Path(run_dir) / RunDir.WEIGHTS
    return DirWeightStore(path, keep=config.weights_keep)


PINS_KEPT = 4  # evaluation points kept: how far the evaluator may fall behind before one is lost


def make_pins(config: Config, run_dir: str | pathlib.Path) -> WeightStore:
    """The store the learner pins evaluation points in (keyed by learner step) and the evaluator
    reads (`headrace.runtime.supervise.Evaluator`): in memory beside a memory weight store, else
    RUN_DIR/eval_weights."""
    if config.weights.backend == "memory":
        return MemoryWeightStore(PINS_KEPT)
    from headrace.weights.directory import DirWeightStore

    return DirWeightStore(pathlib.Path(run_dir) / RunDir.PINS, keep=PINS_KEPT)


def clear_pins(run_dir: str | pathlib.Path) -> None:
    """Removes RUN_DIR/eval_weights (a resume: its pins are of steps trained again)."""
    import shutil

    shutil.rmtree(pathlib.Path(run_dir) / RunDir.PINS, ignore_errors=True)


def check_flow(config: Config) -> None:
    """Refuses settings under which the pipeline would deadlock, with the reason."""
    lc, b = config.learner, config.buffer
    needed = lc.groups_per_batch * (config.run.checkpoint_every + 1)
    checkpoints = config.run.launcher != "threads"  # the threads launcher keeps none
    if checkpoints and config.run.checkpoint_every and b.max_pending < needed:
        raise ConfigError(
            f"buffer.max_pending={b.max_pending}: entries stay pending until the checkpoint "
            f"that covers them, so it must be >= learner.groups_per_batch x "
            f"(run.checkpoint_every + 1) = {needed}")
    if b.max_pending < lc.groups_per_batch * 2:
        raise ConfigError(f"buffer.max_pending={b.max_pending}: must be >= 2 x "
                          f"learner.groups_per_batch = {2 * lc.groups_per_batch}")
    from headrace.parallel import multihost

    multihost.check(config)


def make_run_dir(config: Config) -> pathlib.Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = pathlib.Path(config.run.dir.format(env=config.env.name.replace(":", "."), time=stamp))
    path.mkdir(parents=True, exist_ok=True)
    write_config(path / RunDir.CONFIG, config)
    return path


def write_config(path: pathlib.Path, config: Config) -> None:
    """Writes the resolved config as YAML, without `buffer.password` (it is never written)."""
    text = yaml.safe_dump(without_secrets(config).to_dict(), sort_keys=False)
    if config.buffer.password:
        text = ("# buffer.password is not written here: give it again with "
                f"{PASSWORD_ENV} (or --set) to resume\n" + text)
    path.write_text(text)


def trace_path(config: Config, run_dir: pathlib.Path) -> pathlib.Path | None:
    """RUN_DIR/traces.jsonl when tracing is on (`run.trace_rate` > 0), else None."""
    return run_dir / RunDir.TRACES if config.run.trace_rate > 0 else None


def write_json(path: pathlib.Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
