"""One table of partition rules: parameter path -> mesh axes per dimension, and its checks.

Paths are the flattened parameter paths of `headrace.model.transformer` (`params.flatten`:
"embed.embedding", "layers.3.attn.q.kernel", ...). A rule is (path regex, one entry per
dimension); an entry is None (not split), an axis name, or a tuple of axis names (major to minor).
The first rule whose regex `re.search`es the path wins; `config.parallel.rules` overrides come
before the built-in table, e.g. `{"embed\\.embedding$": [null, "fsdp"]}`.

Kernels are stored [in, out]. The table (Megatron-style tensor parallelism inside ZeRO-3):

| parameter                 | shape                | dim 0    | dim 1    |
|---------------------------|----------------------|----------|----------|
| embed.embedding           | [vocab, d]           | tensor   | fsdp     |
| attn.q/k/v.kernel         | [d, heads * e]       | fsdp     | tensor   |
| attn.q/k/v.bias           | [heads * e]          | tensor   |          |
| attn.o.kernel             | [heads * e, d]       | tensor   | fsdp     |
| mlp.gate/up.kernel        | [d, ff]              | fsdp     | tensor   |
| mlp.down.kernel           | [ff, d]              | tensor   | fsdp     |
| unembed.kernel            | [d, vocab]           | fsdp     | tensor   |
| *norm.scale               | [d] or [e]           | -        |          |

(A tied model has no unembed.kernel: its logits use embed.embedding's vocabulary block.)

A dimension that its axes' sizes do not divide falls back to not split (replicated on that
dimension); so does a parameter no rule matches. `replication_report` lists both, with the share
of bytes held whole on every device, and raises `ReplicationError` above a configured share.

Optimizer state mirrors the parameters: `specs_like(tree, plan)` gives every leaf whose path ends
in a parameter's path and has that parameter's shape (Adam's mu and nu, the reference policy, the
gradient accumulator) the parameter's spec; everything else (step counters) is replicated.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from headrace.config import ConfigError
from headrace.parallel.mesh import AXES, FSDP, MODEL_AXES, TENSOR, axis_size

AxisEntry = str | tuple[str, ...] | None
Rule = tuple[str, tuple[AxisEntry, ...]]

RULES: tuple[Rule, ...] = (
    (r"(^|\.)embed\.embedding$", (TENSOR, FSDP)),  # vocabulary-parallel rows, model dim over fsdp
    (r"\.attn\.[qkv]\.kernel$", (FSDP, TENSOR)),  # column-parallel: heads over tensor
    (r"\.attn\.[qkv]\.bias$", (TENSOR,)),  # with their columns
    (r"\.attn\.o\.kernel$", (TENSOR, FSDP)),  # row-parallel: heads over tensor
    (r"\.mlp\.(gate|up)\.kernel$", (FSDP, TENSOR)),  # column-parallel: hidden over tensor
    (r"\.mlp\.down\.kernel$", (TENSOR, FSDP)),  # row-parallel: hidden over tensor
    (r"(^|\.)unembed\.kernel$", (FSDP, TENSOR)),  # vocabulary-parallel logits
    (r"norm\.scale$", (None,)),  # small: replicated
)
DEFAULT_MAX_REPLICATED_SHARE = 0.05


class ReplicationError(ConfigError):
    """More of the parameters' bytes are held whole on every device than allowed."""


def _entry(value: Any, where: str) -> AxisEntry:
    if value is None or (isinstance(value, str) and value in AXES):
        return value
    if isinstance(value, (list, tuple)) and value and all(v in AXES for v in value):
        return tuple(value) if len(value) > 1 else value[0]
    raise ConfigError(f"{where}={value!r}: each dimension is null, one of {', '.join(AXES)}, or "
                      "a list of them")


def parse_overrides(overrides: Mapping[str, Any] | None) -> tuple[Rule, ...]:
    """`config.parallel.rules` ({path regex: [axes per dimension]}) as rules.

    Raises:
      ConfigError: a regex that does not compile, a value that is not a list, an unknown axis.
    """
    rules = []
    for pattern, dims in (overrides or {}).items():
        where = f"parallel.rules[{pattern!r}]"
        try:
            re.compile(pattern)
        except re.error as error:
            raise ConfigError(f"{where}: not a regular expression ({error})") from None
        if not isinstance(dims, (list, tuple)):
            raise ConfigError(f"{where}={dims!r}: a list with one entry per dimension (null, "
                              "an axis name or a list of axis names)")
        rules.append((pattern, tuple(_entry(d, f"{where}[{i}]") for i, d in enumerate(dims))))
    return tuple(rules)


def _names(entry: AxisEntry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    """Where one parameter lives: its spec on the mesh and why any dimension was not split."""

    path: str
    shape: tuple[int, ...]
    nbytes: int
    spec: PartitionSpec
    notes: tuple[str, ...] = ()  # fallbacks, e.g. "dim 0 (50) not divisible by tensor=4"

    def shards(self, mesh) -> int:
        """How many pieces the parameter is cut into over the model axes (fsdp, tensor)."""
        used = {a for entry in self.spec for a in _names(entry)}
        return math.prod(int(mesh.shape[a]) for a in MODEL_AXES if a in used)


def _path(key_path) -> str:
    """The '.'-joined dict keys of a PyTree key path (attribute and sequence keys skipped)."""
    keys = [str(k.key) for k in key_path if isinstance(k, jax.tree_util.DictKey)]
    return ".".join(keys)


def plan_params(params: Any, mesh, overrides: Mapping[str, Any] | None = None,
                table: Iterable[Rule] = RULES) -> dict[str, ParamPlan]:
    """Applies the rules to every parameter (arrays or `jax.ShapeDtypeStruct`s).

    Returns:
      {path: ParamPlan} in the params' flattening order.

    Raises:
      ConfigError: a bad override (see `parse_overrides`), a rule with the wrong number of
        dimensions for the parameter it matches, or one that names an axis twice.
    """
    rules = parse_overrides(overrides) + tuple(table)
    plan: dict[str, ParamPlan] = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = _path(key_path)
        shape = tuple(int(n) for n in leaf.shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
        match = next(((p, dims) for p, dims in rules if re.search(p, path)), None)
        if match is None:
            plan[path] = ParamPlan(path, shape, nbytes, PartitionSpec(),
                                   ("no partition rule matches: replicated",))
            continue
        pattern, dims = match
        if len(dims) != len(shape):
            raise ConfigError(f"partition rule {pattern!r} -> {list(dims)} has {len(dims)} "
                              f"dimensions but {path} has shape {shape}")
        names = [a for entry in dims for a in _names(entry)]
        if len(names) != len(set(names)):
            raise ConfigError(f"partition rule {pattern!r} -> {list(dims)} names an axis twice")
        spec, notes = [], []
        for d, (size, entry) in enumerate(zip(shape, dims)):
            ways = axis_size(mesh, _names(entry))
            if ways > 1 and size % ways:
                notes.append(f"dim {d} ({size}) not divisible by {'x'.join(_names(entry))}="
                             f"{ways}: not split")
                entry = None
            spec.append(entry)
        plan[path] = ParamPlan(path, shape, nbytes, PartitionSpec(*spec), tuple(notes))
    return plan


def specs_like(tree: Any, plan: Mapping[str, ParamPlan]) -> Any:
    """A PartitionSpec per leaf of `tree` (params, optimizer state, a whole TrainState).

    A leaf takes a parameter's spec when the dict keys along its path end with that parameter's
    path and it has that parameter's shape (optax state mirrors params); otherwise it is
    replicated (scalars such as step counts, or anything else not shaped like a parameter).
    """
    def spec(key_path, leaf):
        keys = [str(k.key) for k in key_path if isinstance(k, jax.tree_util.DictKey)]
        for start in range(len(keys)):
            found = plan.get(".".join(keys[start:]))
            if found is not None and tuple(np.shape(leaf)) == found.shape:
                return found.spec
        return PartitionSpec()

    return jax.tree_util.tree_map_with_path(spec, tree)


def shardings(mesh, specs: Any) -> Any:
    """NamedShardings on `mesh` for a tree of PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


@dataclasses.dataclass(frozen=True)
class ReplicationReport:
    """Parameters not fully split over (fsdp, tensor): each device holds more than 1/(fsdp*tensor).

    `share` is the fraction of all parameter bytes those parameters hold; with fsdp = tensor = 1
    nothing counts as replicated (there is nothing to split over).
    """

    entries: tuple[tuple[str, int, int, tuple[str, ...]], ...]  # (path, bytes, copies, notes)
    replicated_bytes: int
    total_bytes: int

    @property
    def share(self) -> float:
        return self.replicated_bytes / self.total_bytes if self.total_bytes else 0.0

    def format(self) -> str:
        lines = [f"{self.replicated_bytes:,} of {self.total_bytes:,} parameter bytes "
                 f"({100 * self.share:.2f} %) not fully split over fsdp x tensor"]
        for path, nbytes, copies, notes in self.entries:
            why = "; ".join(notes) or "by rule"
            lines.append(f"  {path}: {nbytes:,} B, {copies} copies per fsdp x tensor group ({why})")
        return "\n".join(lines)


def replication_report(plan: Mapping[str, ParamPlan], mesh,
                       max_share: float | None = DEFAULT_MAX_REPLICATED_SHARE
                       ) -> ReplicationReport:
    """Which parameters are (partly) replicated over the model axes, and their share of bytes.

    Args:
      plan: from `plan_params`.
      max_share: fail above this share of bytes (None: only report).

    Raises:
      ReplicationError: the share exceeds `max_share`; the message lists the parameters, their
        bytes and why (no rule, a non-divisible dimension, or a rule that does not split them).
    """
    group = axis_size(mesh, MODEL_AXES)
    entries, replicated, total = [], 0, 0
    for item in plan.values():
        total += item.nbytes
        copies = group // item.shards(mesh)
        if copies > 1:
            replicated += item.nbytes
            entries.append((item.path, item.nbytes, copies, item.notes))
    report = ReplicationReport(tuple(entries), replicated, total)
    if max_share is not None and report.share > max_share:
        raise ReplicationError(
            f"{100 * report.share:.2f} % of parameter bytes are replicated over fsdp x tensor, "
            f"more than the allowed {100 * max_share:.2f} %: pick mesh sizes that divide the "
            f"model's dimensions (e.g. model.vocab_size rounded up to a multiple of tensor), "
            f"raise parallel.max_replicated_share, or add parallel.rules for these parameters.\n"
            f"{report.format()}")
    return report


def bytes_per_device(tree: Any) -> dict[Any, int]:
    """Bytes of `tree`'s live arrays held on each device, from their addressable shards."""
    held: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            held[shard.device] = held.get(shard.device, 0) + int(shard.data.nbytes)
    return held


def max_bytes_per_device(tree: Any) -> int:
    """The largest `bytes_per_device` (0 for a tree without arrays)."""
    return max(bytes_per_device(tree).values(), default=0)
