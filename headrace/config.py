"""One frozen dataclass tree for a whole run, loaded from YAML with `--set a.b=v` overrides.

Every field has a one-line doc (its comment). Values are checked against their annotated types while
loading and against their ranges in `__post_init__`; every failure is a `ConfigError` whose message
names the key, the value and what is allowed, so the command line can print one line and exit 2.
"""

from __future__ import annotations

import dataclasses
import pathlib
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config file, key or value is wrong; the message says which and what is allowed."""


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {allowed}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/{env}-{time}"  # run folder; {env} and {time} are filled in
    mode: Literal["async", "sync"] = "async"  # decoupled actors/learner, or the synchronous baseline
    seed: int = 0  # seeds model init, tasks and sampling
    max_steps: int = 0  # stop after this many learner steps (0: no limit)
    max_wall_s: float = 0.0  # stop after this many seconds from process start (0: no limit)
    max_train_s: float = 0.0  # stop this many seconds after the first trained step (0: no limit)
    eval_every: int = 50  # greedy evaluation every this many learner steps (0: only at the end)
    eval_target: float = 0.9  # success rate that `time_to_target_s` reports reaching
    stop_at_target: bool = False  # end the run once the periodic evaluation reaches eval_target
    checkpoint_every: int = 0  # learner steps between checkpoints (0: only at the end)
    ledger: bool = False  # record every group written, trained, dropped (exact accounting; costly)
    launcher: Literal["threads", "processes", "ray"] = "threads"  # how components are run
    log_every: int = 10  # learner steps between metric records
    trace_rate: float = 0.01  # share of groups traced stage by stage into traces.jsonl (0: off)
    learner_cpus: tuple[int, ...] = ()  # processes launcher: pin the learner (and 1 XLA thread) here
    actor_cpus: tuple[int, ...] = ()  # processes launcher: pin the actors here (empty: anywhere)

    def __post_init__(self):
        _check(self.launcher != "ray", "run.launcher", self.launcher,
               "the Ray launcher is planned, not yet built; use threads or processes")
        for key in ("max_steps", "eval_every", "checkpoint_every"):
            _check(getattr(self, key) >= 0, f"run.{key}", getattr(self, key), "must be >= 0")
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

    def __post_init__(self):
        _check(bool(self.name), "env.name", self.name, "a built-in name or module:Class")
        _check(self.step_timeout_s > 0, "env.step_timeout_s", self.step_timeout_s, "must be > 0")


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """How episodes become tokens (`headrace.text.template`); the default keeps the plain form."""

    template: str = "plain"  # chat template: plain (bare turns), chat (role tokens), or module:NAME
    system: str = ""  # system prompt opening every episode ("": none)
    observation_role: Literal["user", "tool"] = "user"  # role of the observations after the first

    def __post_init__(self):
        _check(bool(self.template), "text.template", self.template,
               "plain, chat, or module:NAME of a ChatTemplate")


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
class ModelConfig:
    preset: Literal["tiny", "small", "custom"] = "tiny"  # fills the sizes below unless custom
    vocab_size: int = 0  # 0: the tokenizer's vocabulary size
    d_model: int = 64  # residual width
    n_layers: int = 2  # transformer blocks
    n_heads: int = 4  # query heads
    n_kv_heads: int = 2  # key/value heads (grouped-query attention)
    d_ff: int = 128  # SwiGLU hidden width
    max_len: int = 4096  # longest sequence (RoPE table size)
    dtype: Literal["float32", "bfloat16"] = "float32"  # parameter and activation dtype
    init_from: str = ""  # start from the weights of this run folder (headrace sft or train)

    def __post_init__(self):
        for key in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_len"):
            _check(getattr(self, key) >= 1, f"model.{key}", getattr(self, key), "must be >= 1")
        _check(self.vocab_size >= 0, "model.vocab_size", self.vocab_size, "must be >= 0")
        _check(self.d_model % self.n_heads == 0, "model.n_heads", self.n_heads,
               f"must divide model.d_model={self.d_model}")
        _check((self.d_model // self.n_heads) % 2 == 0, "model.n_heads", self.n_heads,
               "head size d_model/n_heads must be even (RoPE)")
        _check(self.n_heads % self.n_kv_heads == 0, "model.n_kv_heads", self.n_kv_heads,
               f"must divide model.n_heads={self.n_heads}")


MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128),
    "small": dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=1024),
}


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
class ActorConfig:
    num_actors: int = 1  # actor threads or processes
    envs_per_actor: int = 256  # concurrent episodes per actor (a multiple of group_size)
    group_size: int = 8  # trajectories per task (G)
    cpu_threads: int = 1  # XLA CPU threads per actor process
    max_batch: int = 512  # most episodes in one batched policy call
    batch_wait_ms: float = 2.0  # how long a policy call waits for more episodes to batch with

    def __post_init__(self):
        for key in ("num_actors", "envs_per_actor", "group_size", "cpu_threads", "max_batch"):
            _check(getattr(self, key) >= 1, f"actor.{key}", getattr(self, key), "must be >= 1")
        _check(self.envs_per_actor % self.group_size == 0, "actor.envs_per_actor",
               self.envs_per_actor, f"must be a multiple of actor.group_size={self.group_size}")
        _check(self.batch_wait_ms >= 0, "actor.batch_wait_ms", self.batch_wait_ms, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class BufferConfig:
    backend: Literal["redis", "memory"] = "memory"  # trajectory store
    url: str = ""  # redis://host:port/db; empty: the launcher starts a local redis-server
    password: str = ""  # Redis AUTH password
    capacity: int = 64  # undelivered groups at most; put blocks beyond
    max_pending: int = 1024  # delivered, unacknowledged groups at most
    fsync: Literal["everysec", "always"] = "everysec"  # Redis append-only fsync policy
    claim_idle_s: float = 60.0  # pending entries idle this long go to another consumer
    put_timeout_s: float = 600.0  # a put blocked this long raises BufferFull

    def __post_init__(self):
        _check(self.capacity >= 1, "buffer.capacity", self.capacity, "must be >= 1")
        _check(self.max_pending >= 1, "buffer.max_pending", self.max_pending, "must be >= 1")
        _check(self.claim_idle_s > 0, "buffer.claim_idle_s", self.claim_idle_s, "must be > 0")
        _check(self.put_timeout_s > 0, "buffer.put_timeout_s", self.put_timeout_s, "must be > 0")


@dataclasses.dataclass(frozen=True)
class WeightsConfig:
    backend: Literal["dir", "memory"] = "memory"  # weight store
    path: str = ""  # directory of the dir backend (default: RUN_DIR/weights)
    keep: int = 0  # versions kept (0: max_policy_lag + 2)

    def __post_init__(self):
        _check(self.keep >= 0, "weights.keep", self.keep, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-3  # peak learning rate
    b1: float = 0.9  # Adam beta1
    b2: float = 0.999  # Adam beta2
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    clip_norm: float = 1.0  # global gradient norm clip (0: off)
    schedule: Literal["constant", "cosine"] = "constant"  # learning-rate schedule
    warmup_steps: int = 0  # linear warm-up, in optimizer updates
    decay_steps: int = 10000  # cosine decay length, in optimizer updates

    def __post_init__(self):
        _check(self.lr > 0, "learner.optimizer.lr", self.lr, "must be > 0")
        _check(0 <= self.b1 < 1 and 0 <= self.b2 < 1, "learner.optimizer.b1/b2",
               (self.b1, self.b2), "must be in [0, 1)")
        _check(self.clip_norm >= 0, "learner.optimizer.clip_norm", self.clip_norm, "must be >= 0")
        _check(self.warmup_steps >= 0, "learner.optimizer.warmup_steps", self.warmup_steps,
               "must be >= 0")
        _check(self.decay_steps >= 1, "learner.optimizer.decay_steps", self.decay_steps,
               "must be >= 1")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    kind: Literal["none", "truncated_is", "ppo_clip", "decoupled"] = "ppo_clip"  # off-policy correction
    rho_max: float = 2.0  # truncation of importance weights (truncated_is, decoupled)
    clip_eps: float = 0.2  # PPO ratio clip
    dual_clip: float = 3.0  # dual-clip bound for negative advantages (0: off)
    # Importance ratio per token, per sequence (GSPO), or per decision: the product over the
    # sequence's loss tokens so far (`headrace.learner.losses`).
    level: Literal["token", "sequence", "prefix"] = "token"

    def __post_init__(self):
        _check(self.rho_max >= 1, "learner.loss.rho_max", self.rho_max, "must be >= 1")
        _check(0 < self.clip_eps < 1, "learner.loss.clip_eps", self.clip_eps, "must be in (0, 1)")
        _check(self.dual_clip == 0 or self.dual_clip > 1, "learner.loss.dual_clip", self.dual_clip,
               "must be 0 (off) or > 1")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    groups_per_batch: int = 64  # groups consumed per learner step
    publish_every: int = 1  # learner steps between weight publishes
    optimizer: OptimizerConfig = OptimizerConfig()  # AdamW settings
    loss: LossConfig = LossConfig()  # policy-gradient loss and its correction
    advantage: Literal["grpo", "rloo"] = "grpo"  # group-relative baseline
    advantage_std_norm: bool = False  # divide advantages by the group's reward std
    loss_agg: Literal["token_mean", "sequence_mean"] = "token_mean"  # loss aggregation
    entropy_coef: float = 0.0  # entropy bonus weight
    kl_coef: float = 0.0  # KL-to-reference weight (reference: the initial policy)
    minibatches: int = 1  # optimizer updates per pass over the step's groups
    epochs: int = 1  # passes over the step's groups (updates per trajectory; PPO's epochs)
    token_budget: int = 0  # tokens per microbatch at most (0: one microbatch per minibatch)

    def __post_init__(self):
        _check(self.groups_per_batch >= 1, "learner.groups_per_batch", self.groups_per_batch,
               "must be >= 1")
        _check(self.publish_every >= 1, "learner.publish_every", self.publish_every, "must be >= 1")
        _check(self.minibatches >= 1, "learner.minibatches", self.minibatches, "must be >= 1")
        _check(self.epochs >= 1, "learner.epochs", self.epochs, "must be >= 1")
        _check(self.groups_per_batch % self.minibatches == 0, "learner.minibatches",
               self.minibatches, f"must divide learner.groups_per_batch={self.groups_per_batch}")
        _check(self.entropy_coef >= 0, "learner.entropy_coef", self.entropy_coef, "must be >= 0")
        _check(self.kl_coef >= 0, "learner.kl_coef", self.kl_coef, "must be >= 0")
        _check(self.token_budget >= 0, "learner.token_budget", self.token_budget, "must be >= 0")


def _default_buckets() -> tuple[int, ...]:
    return tuple(2**i for i in range(5, 13))


@dataclasses.dataclass(frozen=True)
class ShapesConfig:
    buckets: tuple[int, ...] = dataclasses.field(default_factory=_default_buckets)  # length ladder
    rows_per_bucket: int = 0  # rows per microbatch for every bucket (0: derived from token_budget)
    overlong: Literal["truncate", "reject"] = "truncate"  # what to do with a too-long trajectory

    def __post_init__(self):
        _check(len(self.buckets) > 0 and all(b >= 2 for b in self.buckets), "shapes.buckets",
               self.buckets, "a non-empty list of lengths >= 2")
        _check(list(self.buckets) == sorted(set(self.buckets)), "shapes.buckets", self.buckets,
               "must be strictly increasing")
        _check(self.rows_per_bucket >= 0, "shapes.rows_per_bucket", self.rows_per_bucket,
               "must be >= 0")


@dataclasses.dataclass(frozen=True)
class StalenessConfig:
    max_policy_lag: int = 4  # groups whose lag exceeds this many versions are dropped
    max_age_s: float = 0.0  # groups older than this (seconds since start) are dropped (0: off)
    forced_lag: int = 0  # experiments: actors act with weights this many versions old

    def __post_init__(self):
        _check(self.max_policy_lag >= 0, "staleness.max_policy_lag", self.max_policy_lag,
               "must be >= 0")
        _check(self.max_age_s >= 0, "staleness.max_age_s", self.max_age_s, "must be >= 0")
        _check(0 <= self.forced_lag <= self.max_policy_lag, "staleness.forced_lag",
               self.forced_lag, f"must be in [0, staleness.max_policy_lag={self.max_policy_lag}]")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    mesh: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"data": 1, "fsdp": 1, "tensor": 1})  # axis sizes (-1: the rest)
    rules: dict[str, Any] = dataclasses.field(default_factory=dict)  # partition-rule overrides
    processes: int = 1  # local learner processes joined by jax.distributed
    max_replicated_share: float = 0.05  # refuse a mesh that leaves more parameter bytes replicated

    def __post_init__(self):
        _check(set(self.mesh) <= {"data", "fsdp", "tensor"}, "parallel.mesh", self.mesh,
               "axes are data, fsdp and tensor")
        _check(sum(v == -1 for v in self.mesh.values()) <= 1
               and all(v == -1 or v >= 1 for v in self.mesh.values()),
               "parallel.mesh", self.mesh, "sizes >= 1, at most one -1")
        _check(self.processes >= 1, "parallel.processes", self.processes, "must be >= 1")
        _check(0 <= self.max_replicated_share <= 1, "parallel.max_replicated_share",
               self.max_replicated_share, "must be in [0, 1]")

    @property
    def sharded(self) -> bool:
        """Whether the learner runs on a mesh (else one device, the plain step)."""
        return self.processes > 1 or any(v != 1 for v in self.mesh.values())


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
        _check(self.run.mode != "sync" or self.learner.publish_every == 1,
               "learner.publish_every", self.learner.publish_every,
               "run.mode sync publishes after every step: must be 1")
        _check(self.model.max_len >= self.shapes.buckets[-1], "model.max_len", self.model.max_len,
               f"must be >= the largest bucket {self.shapes.buckets[-1]}")

    @property
    def weights_keep(self) -> int:
        """Versions the weight store keeps: enough for every admissible lag plus one in flight."""
        return max(self.weights.keep, self.staleness.max_policy_lag + 2)

    def to_dict(self) -> dict[str, Any]:
        return plain(dataclasses.asdict(self))


def plain(value: Any) -> Any:
    """Dataclass-dict output with tuples as lists (YAML- and JSON-friendly)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


# --- loading -------------------------------------------------------------------------------------


Converters = dict[Any, Callable[[Any, str], Any]]


def _coerce(value: Any, annotation: Any, key: str, converters: Converters | None = None) -> Any:
    """Checks `value` against a field annotation, converting where YAML is looser than Python.

    `converters` maps annotations of custom types to functions (value, key) -> converted value.
    """
    origin = typing.get_origin(annotation)
    if converters and annotation in converters:
        return converters[annotation](value, key)
    if dataclasses.is_dataclass(annotation):
        return build(annotation, value, key, converters)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        _check(value in allowed, key, value, f"one of {', '.join(map(str, allowed))}")
        return value
    if origin in (types.UnionType, typing.Union):
        for option in typing.get_args(annotation):
            if option is type(None) and value is None:
                return None
            try:
                return _coerce(value, option, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}={value!r}: must be {annotation}")
    if origin is tuple:
        _check(isinstance(value, (list, tuple)), key, value, "must be a list")
        (item_type, _) = typing.get_args(annotation)
        return tuple(_coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        _check(isinstance(value, dict), key, value, "must be a mapping")
        _, value_type = typing.get_args(annotation)
        return {str(k): _coerce(v, value_type, f"{key}.{k}") for k, v in value.items()}
    if annotation is Any:
        return value
    if annotation is bool:
        _check(isinstance(value, bool), key, value, "must be true or false")
        return value
    if annotation is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key, value,
               "must be an integer")
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), key, value,
               "must be a number")
        return float(value)
    if annotation is str:
        _check(isinstance(value, str), key, value, "must be a string")
        return value
    raise TypeError(f"unsupported config annotation {annotation} at {key}")


def build(cls: type, data: Any, prefix: str = "", converters: Converters | None = None) -> Any:
    """Builds the dataclass `cls` from a nested mapping, checking keys and value types.

    Raises:
      ConfigError: an unknown key, a value of the wrong type, or one its `__post_init__` refuses.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'the top level'}={data!r}: must be a mapping of "
                          f"{cls.__name__} keys")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            raise ConfigError(f"{key}: unknown key; {prefix or 'the top level'} has "
                              f"{', '.join(sorted(fields))}")
        kwargs[name] = _coerce(value, hints[name], key, converters)
    if cls is ModelConfig:
        preset = kwargs.get("preset", "tiny")
        sizes = {k: v for k, v in MODEL_PRESETS.get(preset, {}).items() if k not in kwargs}
        kwargs.update(sizes)
    return cls(**kwargs)


def _merge(base: dict, path: list[str], value: Any) -> None:
    for name in path[:-1]:
        node = base.setdefault(name, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(path)}: {name} is not a section")
        base = node
    base[path[-1]] = value


def parse_override(text: str) -> tuple[list[str], Any]:
    """Splits `a.b=v` into (["a", "b"], v), parsing v as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"--set {key}={raw!r}: not valid YAML ({error.problem})") from None
    return key.strip().split("."), value


def read_tree(path: str | pathlib.Path | None, overrides: typing.Sequence[str] = (),
              data: dict | None = None, what: str = "config file") -> dict[str, Any]:
    """A nested mapping from a YAML file (or a dict) with `section.key=value` overrides applied.

    Raises:
      ConfigError: the file is missing, not YAML, or not a mapping; an override is malformed.
    """
    tree: dict[str, Any] = dict(data or {})
    if path is not None:
        path = pathlib.Path(path)
        try:
            loaded = yaml.safe_load(path.read_text())
        except (FileNotFoundError, IsADirectoryError):
            raise ConfigError(f"{path}: no such {what}") from None
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}: not valid YAML{where}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: must be a mapping of sections")
        tree.update(loaded or {})
    for override in overrides:
        keys, value = parse_override(override)
        _merge(tree, keys, value)
    return tree


def import_object(key: str, spec: str, error: type[Exception] = ConfigError) -> Any:
    """The object `module:NAME` names (a user's plug-in: environment class, chat template).

    Raises:
      error: `spec` is not module:NAME, or the module cannot be imported; the message names `key`.
      AttributeError is not raised: a missing NAME gives None, for the caller to check the type.
    """
    import importlib

    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(f"{key}={spec!r}: cannot import {module_name} ({exc})") from None
    return getattr(module, attr, None)


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
