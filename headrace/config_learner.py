"""The learner's sections of the run's config (`headrace.config.Config` holds them): optimizer,
loss, learner, shapes, staleness and the device mesh. Every field has a one-line doc; ranges are
checked in `__post_init__`, each failure a `ConfigError` naming the key."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from headrace.configtree import _check


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
    # off-policy correction (`headrace.learner.losses`; docs/staleness.md compares them)
    kind: Literal["none", "truncated_is", "ppo_clip", "decoupled", "dppo_mask", "m2po"] = "ppo_clip"
    rho_max: float = 2.0  # truncation of importance weights (truncated_is, decoupled)
    clip_eps: float = 0.2  # PPO ratio clip
    clip_eps_high: float = 0.0  # the clip's upper side, 1 + this (DAPO's clip-higher; 0: clip_eps)
    dual_clip: float = 3.0  # dual-clip bound for negative advantages (0: off)
    # Importance ratio per token, per sequence (GSPO), or per decision: the product over the
    # sequence's loss tokens so far (`headrace.learner.losses`).
    level: Literal["token", "sequence", "prefix"] = "token"
    mask_low: float = 0.125  # dppo_mask: tokens whose ratio pi/mu is below this are masked
    mask_high: float = 8.0  # dppo_mask: tokens whose ratio pi/mu is above this are masked
    tv_delta: float = 0.2  # dppo_mask: the trust region's bound on |pi - mu| of a token
    m2_tau: float = 0.04  # m2po: bound on the mean squared log-ratio of the kept tokens

    def __post_init__(self):
        _check(self.rho_max >= 1, "learner.loss.rho_max", self.rho_max, "must be >= 1")
        _check(0 <= self.mask_low < 1, "learner.loss.mask_low", self.mask_low, "must be in [0, 1)")
        _check(self.mask_high > 1, "learner.loss.mask_high", self.mask_high, "must be > 1")
        _check(0 < self.tv_delta <= 1, "learner.loss.tv_delta", self.tv_delta, "must be in (0, 1]")
        _check(self.m2_tau > 0, "learner.loss.m2_tau", self.m2_tau, "must be > 0")
        _check(0 < self.clip_eps < 1, "learner.loss.clip_eps", self.clip_eps, "must be in (0, 1)")
        _check(self.clip_eps_high >= 0, "learner.loss.clip_eps_high", self.clip_eps_high,
               "must be >= 0 (0: learner.loss.clip_eps)")
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
    # Drop groups whose valid members' rewards are all equal (every advantage 0), as DAPO's
    # dynamic sampling does; the batch fills with groups that carry a learning signal...
    drop_uniform_groups: bool = False
    # ...up to this many batches' worth a step; past it the step trains those that come
    uniform_drop_limit: float = 1.0
    # loss aggregation: a token mean, a sequence mean, or token sums over a constant (Dr. GRPO)
    loss_agg: Literal["token_mean", "sequence_mean", "token_sum"] = "token_mean"
    entropy_coef: float = 0.0  # entropy bonus weight
    kl_coef: float = 0.0  # KL-to-reference weight (reference: the initial policy)
    minibatches: int = 1  # optimizer updates per pass over the step's groups
    epochs: int = 1  # passes over the step's groups (updates per trajectory; PPO's epochs)
    token_budget: int = 0  # tokens per microbatch at most (0: one microbatch per minibatch)
    # compile the step for every microbatch shape before the first batch comes, while the actors
    # start (fixed rows only: learner.token_budget or shapes.rows_per_bucket)
    precompile: bool = False
    # float32 logits computed at most this many MiB at a time: a microbatch's tokens in chunks,
    # each recomputed in the backward pass (0: all at once)
    logits_mib: int = 256
    max_nonfinite_steps: int = 10  # consecutive steps with a non-finite update stop the run (0: never)
    # dtype of the learner's parameters, gradients and optimizer state (the master copy); the
    # forward/backward runs on a model.dtype cast of it, and weights are published in model.dtype
    master_dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self):
        _check(self.groups_per_batch >= 1, "learner.groups_per_batch", self.groups_per_batch,
               "must be >= 1")
        _check(self.publish_every >= 1, "learner.publish_every", self.publish_every, "must be >= 1")
        _check(self.uniform_drop_limit > 0, "learner.uniform_drop_limit",
               self.uniform_drop_limit, "must be > 0")
        _check(self.minibatches >= 1, "learner.minibatches", self.minibatches, "must be >= 1")
        _check(self.epochs >= 1, "learner.epochs", self.epochs, "must be >= 1")
        _check(self.groups_per_batch % self.minibatches == 0, "learner.minibatches",
               self.minibatches, f"must divide learner.groups_per_batch={self.groups_per_batch}")
        _check(self.entropy_coef >= 0, "learner.entropy_coef", self.entropy_coef, "must be >= 0")
        _check(self.kl_coef >= 0, "learner.kl_coef", self.kl_coef, "must be >= 0")
        _check(self.token_budget >= 0, "learner.token_budget", self.token_budget, "must be >= 0")
        _check(self.logits_mib >= 0, "learner.logits_mib", self.logits_mib,
               "must be >= 0 (0: the logits of a microbatch at once)")
        _check(self.max_nonfinite_steps >= 0, "learner.max_nonfinite_steps",
               self.max_nonfinite_steps, "must be >= 0 (0: never stop)")


def _default_buckets() -> tuple[int, ...]:
    return tuple(2**i for i in range(5, 13))


@dataclasses.dataclass(frozen=True)
class ShapesConfig:
    buckets: tuple[int, ...] = dataclasses.field(default_factory=_default_buckets)  # length ladder
    rows_per_bucket: int = 0  # rows per microbatch, every bucket (0: from token_budget, or all)
    overlong: Literal["truncate", "reject"] = "truncate"  # what to do with a too-long trajectory
    tail_splits: int = 0  # a partly filled microbatch may use 1/2 .. 1/2^k of its bucket's rows

    def __post_init__(self):
        _check(len(self.buckets) > 0 and all(b >= 2 for b in self.buckets), "shapes.buckets",
               self.buckets, "a non-empty list of lengths >= 2")
        _check(list(self.buckets) == sorted(set(self.buckets)), "shapes.buckets", self.buckets,
               "must be strictly increasing")
        _check(self.rows_per_bucket >= 0, "shapes.rows_per_bucket", self.rows_per_bucket,
               "must be >= 0")
        _check(0 <= self.tail_splits <= 8, "shapes.tail_splits", self.tail_splits,
               "must be in 0..8 (each adds up to one compiled shape per bucket)")


@dataclasses.dataclass(frozen=True)
class StalenessConfig:
    max_policy_lag: int = 4  # groups whose lag exceeds this many versions are dropped
    max_age_s: float = 0.0  # groups older than this (seconds since start) are dropped (0: off)
    forced_lag: int = 0  # experiments: actors act with weights this many versions old
    max_ready_batches: int = 0  # admit while at most this many batches would be ahead when done

    def __post_init__(self):
        _check(self.max_policy_lag >= 0, "staleness.max_policy_lag", self.max_policy_lag,
               "must be >= 0")
        _check(self.max_age_s >= 0, "staleness.max_age_s", self.max_age_s, "must be >= 0")
        _check(self.max_ready_batches >= 0, "staleness.max_ready_batches",
               self.max_ready_batches, "must be >= 0")
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
