"""One frozen dataclass tree for a whole run, loaded from YAML with `--set a.b=v` overrides.

Every field has a one-line doc (its comment). Values are checked against their annotated types while
loading and against their ranges in `__post_init__`; every failure is a `ConfigError` whose message
names the key, the value and what is allowed, so the command line can print one line and exit 2.
Building a typed tree from plain data is `headrace.configtree`'s (the simulator's spec uses it
too); the learner's sections (optimizer, loss, learner, shapes, staleness, parallel) live in
`headrace.config_learner`, the model's (model, its LoRA adapters, presets) in
`headrace.config_model`; both are importable from here.
"""

from __future__ import annotations

import dataclasses
import pathlib
import typing
from typing import Any, Literal

from headrace.config_learner import LearnerConfig, ParallelConfig, ShapesConfig, StalenessConfig
from headrace.config_learner import LossConfig as LossConfig  # re-exported: one import for all
from headrace.config_learner import OptimizerConfig as OptimizerConfig
from headrace.config_model import MODEL_PRESETS as MODEL_PRESETS
from headrace.config_model import LoraConfig as LoraConfig
from headrace.config_model import ModelConfig
from headrace.configtree import ConfigError, _check, build, plain, read_tree


@dataclasses.dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/{env}-{time}"  # run folder; {env} and {time} are filled in
    mode: Literal["async", "sync"] = "async"  # decoupled actors/learner, or the synchronous baseline
    seed: int = 0  # seeds model init, tasks and sampling
    max_steps: int = 0  # stop after this many learner steps (0: no limit)
    # stop after this many seconds (0: no limit), from the `headrace` process's start (from the
    # call when a run is started from Python)
    max_wall_s: float = 0.0
    max_train_s: float = 0.0  # stop this many seconds after the first trained step (0: no limit)
    eval_every: int = 50  # greedy evaluation every this many learner steps (0: only at the end)
    eval_target: float = 0.9  # success rate that `time_to_target_s` reports reaching
    stop_at_target: bool = False  # end the run once the periodic evaluation reaches eval_target
    checkpoint_every: int = 20  # learner steps between checkpoints; entries are acknowledged after
    # the checkpoint that covers them (0: only at the end, acknowledging each step: not crash-safe)
    # how a one-process learner writes its periodic checkpoints: "background" (it trains on while
    # the files are written, and acknowledges once they are complete), "blocking", or "auto":
    # background where the learner runs on an accelerator, blocking on a CPU (there the write
    # takes the cores the actors need: fewer steps per second on 2 cores)
    checkpoint_write: Literal["auto", "background", "blocking"] = "auto"
    ledger: bool = False  # record every group written, trained, dropped (exact accounting; costly)
    launcher: Literal["threads", "processes", "ray"] = "processes"  # how components are run
    log_every: int = 10  # learner steps between metric records
    trace_rate: float = 0.01  # share of groups traced stage by stage into traces.jsonl (0: off)
    learner_cpus: tuple[int, ...] | Literal["auto"] = ()  # processes launcher: placement.py
    actor_cpus: tuple[int, ...] = ()  # processes launcher: the actors' (empty: what the learner leaves)
    ray_address: str = ""  # ray launcher: the cluster to join (empty: $RAY_ADDRESS, else a local one)
    ray_learner_bundle: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"CPU": 1.0})  # ray: resources reserved per learner host (GPU, TPU,
    # or a custom resource that names the learner's nodes)
    ray_actor_bundle: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"CPU": 1.0})  # ray: resources reserved per actor
    ray_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "SPREAD"  # ray:
    # how the placement group lays its bundles over the nodes
    # ray: resources of the node that runs the embedded redis-server (e.g. {CPU: 1,
    # headrace_buffer: 1}); empty: the driver's node
    ray_buffer_bundle: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for key in ("ray_learner_bundle", "ray_actor_bundle", "ray_buffer_bundle"):
            bundle = getattr(self, key)
            if key == "ray_buffer_bundle" and not bundle:
                continue  # the driver's node
            _check(bool(bundle) and all(v >= 0 for v in bundle.values())
                   and any(v > 0 for v in bundle.values()), f"run.{key}", bundle,
                   "must name at least one resource with an amount > 0, none < 0 "
                   "(e.g. {CPU: 1} or {GPU: 1})")
        for key in ("max_steps", "eval_every", "checkpoint_every"):
            _check(getattr(self, key) >= 0, f"run.{key}", getattr(self, key), "must be >= 0")
        for key in ("learner_cpus", "actor_cpus"):
            cpus = [] if getattr(self, key) == "auto" else list(getattr(self, key))
            _check(min(cpus, default=0) >= 0, f"run.{key}", cpus, "CPU ids must be >= 0")
        for key in ("max_wall_s", "max_train_s"):
            _check(getattr(self, key) >= 0, f"run.{key}", getattr(self, key), "must be >= 0")
        _check(0 < self.eval_target <= 1, "run.eval_target", self.eval_target, "must be in (0, 1]")
        _check(self.log_every >= 1, "run.log_every", self.log_every, "must be >= 1")
        _check(0 <= self.trace_rate <= 1, "run.trace_rate", self.trace_rate, "must be in [0, 1]")


@dataclasses.dataclass(frozen=True)
class LatencyConfig:
    kind: Literal["none", "fixed", "lognormal", "trace"] = "none"  # injected delay per env step
    seconds: float = 0.0  # fixed delay, or the median of the lognormal
    sigma: float = 0.5  # lognormal shape
    trace: tuple[float, ...] = ()  # measured delays in seconds, replayed in a loop

    def __post_init__(self):
        _check(self.seconds >= 0, "env.latency.seconds", self.seconds, "must be >= 0")
        _check(self.sigma >= 0, "env.latency.sigma", self.sigma, "must be >= 0")
        _check(self.kind != "trace" or len(self.trace) > 0, "env.latency.trace", self.trace,
               "kind 'trace' needs a non-empty list of seconds")
        _check(all(t >= 0 for t in self.trace), "env.latency.trace", self.trace,
               "delays must be >= 0")


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    name: str = "guess_number"  # built-in name or `module:Class`
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # passed to the constructor
    latency: LatencyConfig = LatencyConfig()  # injected environment latency
    step_timeout_s: float = 30.0  # an env step slower than this ends its episode with status error
    reset_timeout_s: float = 60.0  # an env reset slower than this does too; a timed-out env is
    # discarded (its call may still run on a thread) and replaced by a fresh one

    def __post_init__(self):
        _check(bool(self.name), "env.name", self.name, "a built-in name or module:Class")
        _check(self.step_timeout_s > 0, "env.step_timeout_s", self.step_timeout_s, "must be > 0")
        _check(self.reset_timeout_s > 0, "env.reset_timeout_s", self.reset_timeout_s,
               "must be > 0")


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """How episodes become tokens (`headrace.text.template`, `headrace.text.jinja_template`)."""

    # chat template: auto (the checkpoint's own with model.init_from hf:/gguf:, else plain),
    # plain (bare turns), chat (role tokens), FILE.jinja (a Jinja chat template), or module:NAME
    template: str = "auto"
    system: str = ""  # system prompt opening every episode ("": none)
    observation_role: Literal["user", "tool"] = "user"  # role of the observations after the first
    tools: str = ""  # JSON file of tool (function) schemas shown to a Jinja template ("": none)
    tool_format: Literal["auto", "template", "hermes"] = "auto"  # tools: template syntax or hermes

    def __post_init__(self):
        _check(bool(self.template), "text.template", self.template,
               "auto, plain, chat, FILE.jinja, or module:NAME of a ChatTemplate")


@dataclasses.dataclass(frozen=True)
class SftConfig:
    """`headrace sft`: supervised warm-up on demonstrations (`headrace.sft`)."""

    dir: str = "runs/sft-{env}-{time}"  # run folder of the warm-up; {env} and {time} are filled in
    demos: str = "solver"  # "solver" (the environment's `solve(seed)`) or a JSONL file of them
    episodes: int = 512  # demonstrations the solver plays (task seeds seed_base, seed_base+1, ...)
    seed_base: int = 0  # first task seed of the solver's demonstrations
    steps: int = 300  # optimizer updates
    batch_size: int = 32  # demonstrations per update
    lr: float = 1e-3  # AdamW learning rate (other optimizer settings: learner.optimizer)
    eval_every: int = 100  # greedy evaluation every this many updates (0: only before and after)
    eval_episodes: int = 64  # tasks per greedy evaluation (unless the environment lists its own)

    def __post_init__(self):
        for key in ("episodes", "steps", "batch_size", "eval_episodes"):
            _check(getattr(self, key) >= 1, f"sft.{key}", getattr(self, key), "must be >= 1")
        _check(self.eval_every >= 0, "sft.eval_every", self.eval_every, "must be >= 0")
        _check(self.seed_base >= 0, "sft.seed_base", self.seed_base, "must be >= 0")
        _check(self.lr > 0, "sft.lr", self.lr, "must be > 0")
        _check(bool(self.demos), "sft.demos", self.demos, "'solver' or a JSONL file")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0  # logits are divided by this; log-probs are of this distribution
    top_k: int = 0  # sample among the k likeliest tokens (0: off)
    top_p: float = 1.0  # nucleus sampling mass (1: off)
    max_new_tokens: int = 64  # tokens generated per turn at most
    constrain_to_actions: bool = True  # restrict decoding to the env's action vocabulary, if declared
    # Keep each episode's keys and values on the actor between turns, so a turn computes only its
    # new tokens; earlier turns keep the weights that computed them (PipelineRL). Memory: envs x
    # largest bucket x layers x 2 x kv heads x head size x dtype bytes; more programs to compile.
    keep_cache: bool = False
    # An actor compiles every sampling program its calls can use (each length bucket x each row
    # count of actor.max_batch's ladder) before its first episode, so no compile lands in the
    # steady state (without it, new shapes compile in the background while compiled ones serve).
    precompile: bool = False

    def __post_init__(self):
        _check(self.temperature > 0, "sampling.temperature", self.temperature, "must be > 0")
        _check(self.top_k >= 0, "sampling.top_k", self.top_k, "must be >= 0")
        _check(0 < self.top_p <= 1, "sampling.top_p", self.top_p, "must be in (0, 1]")
        _check(self.max_new_tokens >= 1, "sampling.max_new_tokens", self.max_new_tokens,
               "must be >= 1")


@dataclasses.dataclass(frozen=True)
class VLLMConfig:
    """`actor.engine: vllm` (docs/engines.md): a vLLM OpenAI server per actor, fed by token ids."""

    python: str = ""  # the vLLM environment's interpreter (empty: the repo's .venv-vllm/bin/python)
    url: str = ""  # a running server to use instead of starting one (http://host:port; loopback)
    dtype: Literal["float32", "bfloat16"] = "float32"  # the served weights' dtype (fp32: checked)
    max_model_len: int = 0  # the server's context length (0: the largest shapes.buckets entry)
    kv_cache_gib: float = 1.0  # VLLM_CPU_KVCACHE_SPACE: the KV cache's size in GiB
    threads: int = 1  # CPU threads the server computes with (OMP threads)
    start_timeout_s: float = 300.0  # longest the server may take to become ready
    request_timeout_s: float = 600.0  # longest one generation call may take (a dead server errs)

    def __post_init__(self):
        _check(self.max_model_len >= 0, "actor.vllm.max_model_len", self.max_model_len,
               "must be >= 0 (0: the largest shapes.buckets entry)")
        _check(self.kv_cache_gib > 0, "actor.vllm.kv_cache_gib", self.kv_cache_gib, "must be > 0")
        _check(self.threads >= 1, "actor.vllm.threads", self.threads, "must be >= 1")
        for key in ("start_timeout_s", "request_timeout_s"):
            _check(getattr(self, key) > 0, f"actor.vllm.{key}", getattr(self, key), "must be > 0")
        _check(not self.url or self.url.startswith(("http://", "https://")), "actor.vllm.url",
               self.url, "must be an http:// address (http://127.0.0.1:8000), or empty to start "
               "a server")


@dataclasses.dataclass(frozen=True)
class ActorConfig:
    num_actors: int = 1  # actor threads or processes
    envs_per_actor: int = 256  # concurrent episodes per actor (a multiple of group_size)
    group_size: int = 8  # trajectories per task (G)
    cpu_threads: int = 1  # must be 1 (older configs): XLA:CPU takes a thread per CPU it may use
    # JAX backend of actors and the supervisor's evaluation (auto: cpu on the learner's machine)
    platform: Literal["auto", "cpu", "default"] = "auto"
    max_batch: int = 512  # most episodes in one batched policy call
    batch_wait_ms: float = 2.0  # how long a policy call waits for more episodes to batch with
    max_restarts: int = 5  # processes and ray launchers: crashes in a row (each restarted with backoff 1, 2,
    # 4 ... 30 s) after which an actor's error ends the run; a run of HEALTHY_S resets the count
    engine: Literal["jax", "vllm"] = "jax"  # what generates: the JAX sampler, or a vLLM server
    vllm: VLLMConfig = VLLMConfig()  # the vllm engine's server (docs/engines.md)

    def __post_init__(self):
        for key in ("num_actors", "envs_per_actor", "group_size", "max_batch"):
            _check(getattr(self, key) >= 1, f"actor.{key}", getattr(self, key), "must be >= 1")
        _check(self.cpu_threads == 1, "actor.cpu_threads", self.cpu_threads,
               "must be 1: XLA gives an actor a thread per CPU it may use, so set the CPUs "
               "instead (run.actor_cpus)")
        _check(self.max_restarts >= 0, "actor.max_restarts", self.max_restarts, "must be >= 0")
        _check(self.envs_per_actor % self.group_size == 0, "actor.envs_per_actor",
               self.envs_per_actor, f"must be a multiple of actor.group_size={self.group_size}")
        _check(self.batch_wait_ms >= 0, "actor.batch_wait_ms", self.batch_wait_ms, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class BufferConfig:
    backend: Literal["auto", "redis", "memory"] = "auto"  # trajectory store (auto: the launcher's)
    url: str = ""  # redis://host:port/db; empty: the launcher starts a local redis-server
    password: str = ""  # Redis AUTH password (or $HEADRACE_REDIS_PASSWORD; never in a URL)
    host: str = "127.0.0.1"  # address the embedded redis-server binds (loopback by default)
    port: int = 0  # the embedded redis-server's port (0: a free one)
    transport: Literal["tcp", "unix"] = "tcp"  # embedded server: host:port, or a 0700 socket file
    shards: int = 1  # streams the groups are spread over (by a hash of the actor id)
    urls: tuple[str, ...] = ()  # one Redis per shard (shard 0's also holds admission); not with url
    capacity: int = 64  # undelivered groups at most; put blocks beyond
    max_pending: int = 2048  # delivered, unacknowledged groups at most (>= groups_per_batch x
    # (run.checkpoint_every + 1) under the processes launcher: acks wait for checkpoints)
    fsync: Literal["everysec", "always"] = "everysec"  # Redis append-only fsync policy
    claim_idle_s: float = 60.0  # pending entries idle this long go to another consumer
    put_timeout_s: float = 600.0  # a put blocked this long raises BufferFull

    def __post_init__(self):
        _check(self.capacity >= 1, "buffer.capacity", self.capacity, "must be >= 1")
        _check(self.max_pending >= 1, "buffer.max_pending", self.max_pending, "must be >= 1")
        _check(self.claim_idle_s > 0, "buffer.claim_idle_s", self.claim_idle_s, "must be > 0")
        _check(self.put_timeout_s > 0, "buffer.put_timeout_s", self.put_timeout_s, "must be > 0")
        _check(self.shards >= 1, "buffer.shards", self.shards, "must be >= 1")
        _check(bool(self.host.strip()), "buffer.host", self.host, "must name an address")
        _check(0 <= self.port <= 65535, "buffer.port", self.port, "must be in [0, 65535]")
        _check(not (self.url and self.urls), "buffer.urls", list(self.urls),
               "give buffer.url (one server) or buffer.urls (one per shard), not both")
        _check(not self.urls or self.shards in (1, len(self.urls)), "buffer.shards", self.shards,
               f"buffer.urls names {len(self.urls)} servers: one shard each; leave buffer.shards "
               "out or set it to that number")
        for url in (self.url, *self.urls):
            _check(not _has_password(url), "buffer.url(s)", _redacted(url),
                   "carries a password: give it as buffer.password or $HEADRACE_REDIS_PASSWORD "
                   "(a URL is printed and logged)")

    @property
    def shard_count(self) -> int:
        """How many streams the groups go to: len(urls) when urls are given, else shards."""
        return len(self.urls) or self.shards

    def shard_url(self, shard: int, default: str = "") -> str:
        """The server of `shard`: its entry of `urls`, else `url` (or `default`: an embedded
        server's) for every shard."""
        return self.urls[shard] if self.urls else (self.url or default)


def _has_password(url: str) -> bool:
    import urllib.parse

    try:
        return bool(urllib.parse.urlsplit(url).password)
    except ValueError:
        return False


def _redacted(url: str) -> str:
    """`url` with its password (if any) written as ***: what may be printed."""
    import urllib.parse

    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if not parts.password:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}***@{host}"))


@dataclasses.dataclass(frozen=True)
class WeightsConfig:
    backend: Literal["auto", "dir", "memory", "redis"] = "auto"  # weight store (auto: launcher's)
    path: str = ""  # directory of the dir backend (default: RUN_DIR/weights)
    keep: int = 0  # versions kept: at least max_policy_lag + 2 (`weights_keep`)
    # Redis server of the redis backend, redis://[user@]host:port/db (empty: the buffer's server,
    # the run's embedded one by default); its password is the buffer's unless the URL has one.
    url: str = ""
    chunk_mib: int = 8  # redis backend: MiB per chunk of an array (published and read in chunks)
    namespace: str = ""  # redis backend: the versions' key namespace (empty: the run folder's name)

    def __post_init__(self):
        _check(self.keep >= 0, "weights.keep", self.keep, "must be >= 0")
        _check(1 <= self.chunk_mib <= 64, "weights.chunk_mib", self.chunk_mib,
               "must be in 1 .. 64 (4 chunks in flight stay under Redis's 1 GiB query buffer)")
        _check(not self.url or self.url.startswith(("redis://", "rediss://", "unix://")),
               "weights.url", self.url, "must be a redis://, rediss:// or unix:// URL")


@dataclasses.dataclass(frozen=True)
class Config:
    run: RunConfig = RunConfig()
    env: EnvConfig = EnvConfig()
    model: ModelConfig = ModelConfig()
    sampling: SamplingConfig = SamplingConfig()
    actor: ActorConfig = ActorConfig()
    buffer: BufferConfig = BufferConfig()
    weights: WeightsConfig = WeightsConfig()
    learner: LearnerConfig = LearnerConfig()
    shapes: ShapesConfig = ShapesConfig()
    staleness: StalenessConfig = StalenessConfig()
    parallel: ParallelConfig = ParallelConfig()
    text: TextConfig = TextConfig()
    sft: SftConfig = SftConfig()

    def __post_init__(self):
        self._resolve_backends()
        _check(self.run.mode != "sync" or self.learner.publish_every == 1,
               "learner.publish_every", self.learner.publish_every,
               "run.mode sync publishes after every step: must be 1")
        _check(self.model.max_len >= self.shapes.buckets[-1], "model.max_len", self.model.max_len,
               f"must be >= the largest bucket {self.shapes.buckets[-1]}")
        _check(not self.learner.precompile or bool(self.learner.token_budget
                                                    or self.shapes.rows_per_bucket),
               "learner.precompile", self.learner.precompile, "needs fixed rows, so that every "
               "microbatch shape is known before the data: set learner.token_budget or "
               "shapes.rows_per_bucket (or learner.precompile: false)")
        _check(not (self.model.lora.rank and self.parallel.sharded), "model.lora.rank",
               self.model.lora.rank, "LoRA trains on one learner device (the sharded learner "
               "has no adapter rules yet): set model.lora.rank: 0 or parallel.mesh to one device "
               "and parallel.processes: 1")
        n, cpus = self.parallel.processes, self.run.learner_cpus
        _check(cpus in ((), "auto") or self.run.launcher != "processes" or len(cpus) >= n,
               "run.learner_cpus", list(cpus), f"each of the {n} learner processes gets CPUs "
               f"of its own from this list: name at least {n}, [] (unpinned) or auto")
        _check(self.buffer.shard_count == 1 or self.run.launcher == "processes",
               "buffer.shards", self.buffer.shard_count, "shards are Redis streams that actor "
               "processes write to by their ids: needs run.launcher=processes")
        if self.actor.engine == "vllm":
            self._check_vllm()

    def _check_vllm(self) -> None:
        """`actor.engine: vllm` reads published weights from the directory store (its worker
        extension runs in vLLM's own process) and must report the log-probs the learner
        recomputes: the untruncated, temperature-scaled distribution."""
        _check(self.weights.backend == "dir", "weights.backend", self.weights.backend,
               "actor.engine=vllm loads versions from the directory store inside vLLM's "
               "process: set weights.backend: dir")
        _check(self.sampling.top_k == 0 and self.sampling.top_p == 1.0, "sampling.top_k/top_p",
               (self.sampling.top_k, self.sampling.top_p), "actor.engine=vllm reports log-probs "
               "after truncation, which the learner does not apply: use top_k 0 and top_p 1")

    def _resolve_backends(self) -> None:
        """`auto` backends become the launcher's: memory under threads; Redis and the directory
        store under processes, which share no memory, so naming `memory` there is refused."""
        launcher = self.run.launcher
        chosen = {"buffer": "memory" if launcher == "threads" else "redis",
                  "weights": "memory" if launcher == "threads" else "dir"}
        for section, default in chosen.items():
            current = getattr(self, section)
            if current.backend == "auto":  # frozen: set once, here, before anyone reads it
                object.__setattr__(self, section, dataclasses.replace(current, backend=default))
            elif current.backend == "memory" and launcher != "threads":
                raise ConfigError(
                    f"{section}.backend='memory' with run.launcher={launcher!r}: the processes "
                    f"launcher's learner and actors share no memory; set {section}.backend: "
                    f"{default} (or leave it out: the launcher chooses), or run.launcher: threads")

    @property
    def weights_keep(self) -> int:
        """Versions the weight store keeps: enough for every admissible lag plus one in flight."""
        return max(self.weights.keep, self.staleness.max_policy_lag + 2)

    def to_dict(self) -> dict[str, Any]:
        return plain(dataclasses.asdict(self))


def load(path: str | pathlib.Path | None = None, overrides: typing.Sequence[str] = (),
         data: dict | None = None) -> Config:
    """Builds a Config from a YAML file (or a dict) plus `section.key=value` overrides.

    Raises:
      ConfigError: the file is missing or not YAML, a key is unknown, or a value has the wrong type
        or is out of range. The message names the key, the value and what is allowed.
    """
    return build(Config, read_tree(path, overrides, data))


def replace(config: Config, **sections: dict[str, Any]) -> Config:
    """A copy of `config` with some keys of some sections changed, validated again."""
    tree = config.to_dict()
    for section, values in sections.items():
        tree[section].update(values)
    return build(Config, tree)
