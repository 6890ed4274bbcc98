"""What `headrace simulate` simulates: a frozen dataclass tree of the planned pipeline, from YAML.

Every timing is a `Dist`: a parametric form (`fixed`, `lognormal`, `exponential`) or an `empirical`
list of measured samples (what the latency audit hands over), drawn with replacement. In YAML a
distribution is written as a mapping (`{kind: lognormal, median: 2.0, sigma: 0.5}`), a bare number
(fixed) or a bare list of numbers (empirical).

Every failure while loading is a `headrace.config.ConfigError` whose message names the dotted key,
the value and what is allowed, so the command line prints one line and exits 2.
"""

from __future__ import annotations

import dataclasses
import pathlib
import typing
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from headrace.configtree import ConfigError, _check, _coerce, build, plain, read_tree

DIST_KEYS: dict[str, tuple[str, ...]] = {
    "fixed": ("value",),
    "lognormal": ("median", "sigma"),
    "exponential": ("mean",),
    "empirical": ("samples",),
}


@dataclasses.dataclass(frozen=True)
class Dist:
    """A distribution of a non-negative quantity (seconds, or turns once rounded)."""

    kind: Literal["fixed", "lognormal", "exponential", "empirical"] = "fixed"
    value: float = 0.0  # fixed: the value
    median: float = 0.0  # lognormal: the median (exp of the log-mean)
    sigma: float = 0.0  # lognormal: the standard deviation of the log
    mean: float = 0.0  # exponential: the mean
    samples: tuple[float, ...] = ()  # empirical: measured values, drawn with replacement

    def __post_init__(self):
        _check(self.kind in DIST_KEYS, "kind", self.kind, f"one of {', '.join(DIST_KEYS)}")
        for key in ("value", "median", "sigma", "mean"):
            _check(np.isfinite(getattr(self, key)) and getattr(self, key) >= 0, key,
                   getattr(self, key), "must be a finite number >= 0")
        _check(self.kind != "lognormal" or self.median > 0, "median", self.median,
               "kind lognormal needs median > 0")
        _check(self.kind != "exponential" or self.mean > 0, "mean", self.mean,
               "kind exponential needs mean > 0")
        _check(self.kind != "empirical" or len(self.samples) > 0, "samples", self.samples,
               "kind empirical needs a non-empty list of measured values")
        _check(all(np.isfinite(s) and s >= 0 for s in self.samples), "samples",
               self.samples[:5], "measured values must be finite and >= 0")

    @property
    def expected(self) -> float:
        """The mean of the distribution."""
        if self.kind == "fixed":
            return self.value
        if self.kind == "lognormal":
            return self.median * float(np.exp(self.sigma**2 / 2))
        if self.kind == "exponential":
            return self.mean
        return float(np.mean(self.samples))

    @property
    def is_zero(self) -> bool:
        return self.kind == "fixed" and self.value == 0

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` independent draws as float64."""
        if self.kind == "fixed":
            return np.full(n, self.value)
        if self.kind == "lognormal":
            return self.median * np.exp(self.sigma * rng.standard_normal(n))
        if self.kind == "exponential":
            return rng.exponential(self.mean, n)
        return rng.choice(np.asarray(self.samples, dtype=np.float64), n)


class Sampler:
    """Scalar draws from a Dist, drawn `chunk` at a time in one numpy call (fast per draw)."""

    def __init__(self, dist: Dist, rng: np.random.Generator, chunk: int = 1024):
        self._dist = dist
        self._rng = rng
        self._chunk = chunk
        self._values: list[float] = []
        self.constant = dist.value if dist.kind == "fixed" else None

    def __call__(self) -> float:
        if self.constant is not None:
            return self.constant
        if not self._values:
            self._values = self._dist.sample(self._rng, self._chunk)[::-1].tolist()
        return self._values.pop()


def fixed(value: float) -> Dist:
    return Dist(kind="fixed", value=float(value))


@dataclasses.dataclass(frozen=True)
class InferenceSpec:
    """One batched policy call per turn: it takes `fixed_s + per_row_s * rows`."""

    fixed_s: float = 0.0  # time of a call regardless of its rows (weights read, launch)
    per_row_s: float = 0.0  # time added per episode in the call
    max_batch: int = 512  # most episodes in one call; the rest wait for the next
    wait_s: float = 0.0  # an idle sampler waits this long for more episodes before a call

    def __post_init__(self):
        for key in ("fixed_s", "per_row_s", "wait_s"):
            _check(getattr(self, key) >= 0, f"actors.inference.{key}", getattr(self, key),
                   "must be >= 0")
        _check(self.max_batch >= 1, "actors.inference.max_batch", self.max_batch, "must be >= 1")

    @property
    def is_zero(self) -> bool:
        return self.fixed_s == 0 and self.per_row_s == 0 and self.wait_s == 0


@dataclasses.dataclass(frozen=True)
class ActorSpec:
    """The actor fleet: each actor runs envs_per_actor / group_size groups at a time."""

    count: int = 100  # actor processes in the fleet
    envs_per_actor: int = 8  # concurrent episodes per actor (a multiple of group_size)
    group_size: int = 8  # episodes per group (G); a group is put when all G are done
    turns: Dist = fixed(4)  # turns per episode (draws are rounded, at least 1)
    env_step_s: Dist = Dist(kind="lognormal", median=1.0, sigma=0.5)  # one environment step
    inference: InferenceSpec = InferenceSpec()  # the batched policy call of each turn
    pickup_s: Dist = fixed(0.0)  # from a publish until an actor samples with the new weights

    def __post_init__(self):
        for key in ("count", "envs_per_actor", "group_size"):
            _check(getattr(self, key) >= 1, f"actors.{key}", getattr(self, key), "must be >= 1")
        _check(self.envs_per_actor % self.group_size == 0, "actors.envs_per_actor",
               self.envs_per_actor, f"must be a multiple of actors.group_size={self.group_size}")

    @property
    def slots(self) -> int:
        """Groups one actor generates at a time."""
        return self.envs_per_actor // self.group_size


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    capacity: int = 256  # undelivered groups at most; a put blocks beyond
    put_s: Dist = fixed(0.0)  # latency of one put (XADD)
    get_s: Dist = fixed(0.0)  # latency of one read by the learner (XREADGROUP)

    def __post_init__(self):
        _check(self.capacity >= 1, "buffer.capacity", self.capacity, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class LearnerSpec:
    step_s: Dist = fixed(1.0)  # one train step (groups_per_batch groups)
    groups_per_batch: int = 64  # groups consumed per learner step
    publish_every: int = 1  # learner steps between weight publishes
    publish_s: Dist = fixed(0.0)  # the learner's time to publish weights (not training)
    prefetch: int = 1  # batches the reader assembles ahead of the one being trained

    def __post_init__(self):
        _check(self.groups_per_batch >= 1, "learner.groups_per_batch", self.groups_per_batch,
               "must be >= 1")
        _check(self.publish_every >= 1, "learner.publish_every", self.publish_every,
               "must be >= 1")
        _check(self.prefetch >= 0, "learner.prefetch", self.prefetch, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class StalenessSpec:
    max_policy_lag: int = 4  # the learner's gate drops groups whose lag exceeds this
    admission: bool = True  # actors start a group only if its forecast lag is within the limit
    max_ready_batches: int = 0  # admission's ready cap (0: off; `versions.too_many_ready`)

    def __post_init__(self):
        _check(self.max_policy_lag >= 0, "staleness.max_policy_lag", self.max_policy_lag,
               "must be >= 0")
        _check(self.max_ready_batches >= 0, "staleness.max_ready_batches",
               self.max_ready_batches, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class SimSpec:
    duration_s: float = 600.0  # simulated pipeline time
    model: Literal["aggregated", "fine"] = "aggregated"  # groups as the unit, or every turn
    actors: ActorSpec = ActorSpec()
    buffer: BufferSpec = BufferSpec()
    learner: LearnerSpec = LearnerSpec()
    staleness: StalenessSpec = StalenessSpec()

    def __post_init__(self):
        _check(np.isfinite(self.duration_s) and self.duration_s > 0, "duration_s",
               self.duration_s, "must be a number > 0")

    def to_dict(self) -> dict[str, Any]:
        return plain(dataclasses.asdict(self))


# --- loading -------------------------------------------------------------------------------------


def _dist(value: Any, key: str) -> Dist:
    """A Dist from YAML: a number (fixed), a list (empirical) or a mapping with `kind`."""
    if isinstance(value, Dist):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = {"kind": "fixed", "value": value}
    elif isinstance(value, (list, tuple)):
        value = {"kind": "empirical", "samples": list(value)}
    if not isinstance(value, dict):
        raise ConfigError(f"{key}={value!r}: a distribution is a number, a list of samples or "
                          f"a mapping {{kind: fixed|lognormal|exponential|empirical, ...}}")
    kind = value.get("kind")
    if kind not in DIST_KEYS:
        raise ConfigError(f"{key}.kind={kind!r}: one of {', '.join(DIST_KEYS)}")
    for name in value:
        if name != "kind" and name not in DIST_KEYS[kind]:
            raise ConfigError(f"{key}.{name}: not a parameter of kind {kind}; it takes "
                              f"{', '.join(DIST_KEYS[kind])}")
    for name in DIST_KEYS[kind]:
        if name not in value:
            raise ConfigError(f"{key}: kind {kind} needs {', '.join(DIST_KEYS[kind])}")
    hints = typing.get_type_hints(Dist)
    kwargs = {name: _coerce(v, hints[name], f"{key}.{name}") for name, v in value.items()}
    try:
        return Dist(**kwargs)
    except ConfigError as error:
        raise ConfigError(f"{key}.{error}") from None


def load_spec(path: str | pathlib.Path | None = None, overrides: Sequence[str] = (),
              data: dict | None = None) -> SimSpec:
    """Builds a SimSpec from a YAML file (or a dict) plus `section.key=value` overrides.

    Raises:
      ConfigError: the file is missing or not YAML, a key is unknown, or a value has the wrong type
        or is out of range. The message names the dotted key, the value and what is allowed.
    """
    tree = read_tree(path, overrides, data, what="spec file")
    return build(SimSpec, tree, converters={Dist: _dist})


def with_actors(spec: SimSpec, count: int) -> SimSpec:
    """The same spec with a fleet of `count` actors."""
    return dataclasses.replace(spec, actors=dataclasses.replace(spec.actors, count=count))
