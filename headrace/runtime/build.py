"""The composition root: every component of a run built from one Config.

Actor code and learner code never import each other; this module is where they meet.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import time
from collections.abc import Callable

import jax.numpy as jnp
import yaml

from headrace.buffer.base import Buffer
from headrace.buffer.memory import MemoryBuffer
from headrace.config import Config, ConfigError
from headrace.env.base import Env
from headrace.env.registry import env_factory
from headrace.model import params as params_lib
from headrace.model.sampler import Sampler, SamplerSettings
from headrace.model.transformer import ModelDims
from headrace.text.template import make_tokenizer
from headrace.text.tokenizers import EOS, Tokenizer, WordTokenizer
from headrace.weights.base import WeightStore
from headrace.weights.memory import MemoryWeightStore


def process_start_time() -> float:
    """Unix time this process started (so wall clocks include interpreter and JAX start-up)."""
    try:
        ticks = int(pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        import os

        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


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
    tokenizer = make_tokenizer(spec.vocabulary, config.text)  # carries the chat template
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
                               stop_ids=(EOS,), allowed_ids=allowed)
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


def make_buffer(config: Config, *, url: str = "", run_id: str = "", consumer: str = "") -> Buffer:
    """The configured buffer; the Redis backend needs the server's url and this run's id."""
    b = config.buffer
    if b.backend == "memory":
        return MemoryBuffer(b.capacity, b.max_pending, b.claim_idle_s)
    from headrace.buffer.redis_stream import RedisBuffer

    return RedisBuffer.from_config(b, url, run_id, consumer)


def make_admission(config: Config, buffer: Buffer, *, url: str = "", run_id: str = ""):
    """Admission control shared by the learner and every actor (in-process, or in Redis)."""
    from headrace.buffer.admission import AdmissionLimits, InProcessAdmission

    limits = AdmissionLimits.from_config(config)
    if not url:
        return InProcessAdmission(limits, counts=buffer.counts)
    from headrace.buffer.admission_redis import RedisAdmission

    return RedisAdmission(url, limits, run_id=run_id, password=config.buffer.password or None)


def make_weights(config: Config, run_dir: str | pathlib.Path | None = None) -> WeightStore:
    if config.weights.backend == "memory":
        return MemoryWeightStore(config.weights_keep)
    from headrace.weights.directory import DirWeightStore

    if run_dir is None and not config.weights.path:
        raise ConfigError("weights.backend='dir' needs weights.path or a run folder")
    path = config.weights.path or pathlib.Path(run_dir) / "weights"
    return DirWeightStore(path, keep=config.weights_keep)


def check_flow(config: Config) -> None:
    """Refuses settings under which the pipeline would deadlock, with the reason."""
    lc, b = config.learner, config.buffer
    needed = lc.groups_per_batch * (config.run.checkpoint_every + 1)
    if config.run.checkpoint_every and b.max_pending < needed:
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
    (path / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    return path


def trace_path(config: Config, run_dir: pathlib.Path) -> pathlib.Path | None:
    """RUN_DIR/traces.jsonl when tracing is on (`run.trace_rate` > 0), else None."""
    from headrace.audit.traces import TRACES_FILE

    return run_dir / TRACES_FILE if config.run.trace_rate > 0 else None


def write_json(path: pathlib.Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
