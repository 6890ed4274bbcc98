"""`headrace plan`: the learner's bytes per device on a mesh, from shapes alone (nothing allocated).

Parameters, gradient accumulator and optimizer state come from `jax.eval_shape` (the model's
parameter tree, `optimizer.init` on it) laid out by the partition rules (`rules.plan_params`,
`rules.specs_like`) on a `jax.sharding.AbstractMesh`: each leaf's bytes divided by the number of
pieces its spec cuts it into, so they are exact (the test compares them with `addressable_shards`).
All three are in the master dtype (`learner.master_dtype`).

Activations are an estimate, per device, for `tokens` tokens per device in rows of `seq_len`
(the compute dtype's bytes, `model.dtype`): with `remat: block` every block's input is kept
(L x tokens x d) plus one block's intermediates, live while that block is recomputed and
differentiated; with `remat: none` every block's intermediates are kept. A block's intermediates
per token: the norms' outputs, q/k/v (RoPE'd q and k again), the attention output, o's output,
the residuals, gate/up, the activation and its product, down's output, and the attention
probabilities (causal tiles: about seq_len / 2 + QUERY_CHUNK / 2 keys per query); tensor-split
parts divided by `tensor`. Plus the float32 logits, their log-softmax and gradient (3 x tokens x
v / tensor), of one chunk of tokens when `learner.logits_mib` (`logits_mib`) cuts them into chunks
(`headrace.model.logprobs`). XLA's own buffer assignment (fusion, reuse, layouts) differs from
this count; the test bounds the ratio to the compiled program's `memory_analysis()` temp bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from headrace.config import ConfigError, LearnerConfig
from headrace.model import logprobs
from headrace.model import params as params_lib
from headrace.model.dims import ModelDims
from headrace.model.transformer import QUERY_CHUNK
from headrace.parallel import rules as rules_lib
from headrace.parallel.mesh import AXES, TENSOR, axis_size, resolve_sizes

GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Plan:
    mesh: dict[str, int]
    params: int  # bytes per device (the most loaded device)
    grads: int
    optimizer: int
    activations: int  # estimate
    tokens: int  # per device
    remat: bool

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total": self.total}


def abstract_mesh(sizes: dict[str, int], devices: int | None = None) -> AbstractMesh:
    """An AbstractMesh (data, fsdp, tensor) of `sizes` (-1: the rest of `devices`)."""
    shape = resolve_sizes(sizes, devices or math.prod(v for v in sizes.values() if v > 0))
    return AbstractMesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def _shard_bytes(tree: Any, specs: Any, mesh) -> int:
    total = 0
    for leaf, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(
            specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
        shape = list(leaf.shape)
        for d, entry in enumerate(spec):
            shape[d] //= axis_size(mesh, entry)
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def block_activations_per_token(dims: ModelDims, tensor: int, seq_len: int) -> float:
    """Elements of one block's intermediates per token on one device (see the module)."""
    d, f, e = dims.d_model, dims.d_ff, dims.head_dim
    h, g = dims.n_heads, dims.n_kv_heads
    tp = lambda n: n / tensor if n % tensor == 0 else n  # noqa: E731 (split only if divisible)
    keys = min(seq_len, seq_len / 2 + QUERY_CHUNK / 2)
    return (6 * d + 2 * tp(h * e) + 4 * tp(g * e) + tp(h * e) + 4 * tp(f)
            + tp(h) * keys * 2)  # probabilities and their float32 scores' share


def plan(dims: ModelDims, mesh, optimizer, *, tokens: int, seq_len: int, remat: bool,
         master_dtype: str = "float32", overrides: dict | None = None,
         logits_mib: int = LearnerConfig.logits_mib) -> Plan:
    """Bytes per device of the learner's state and activations on `mesh` (see the module)."""
    master = dataclasses.replace(dims, dtype=master_dtype)
    abstract = jax.eval_shape(lambda: params_lib.init(master, 0)[1])
    table = rules_lib.plan_params(abstract, mesh, overrides)
    param_bytes = _shard_bytes(abstract, rules_lib.specs_like(abstract, table), mesh)
    opt = jax.eval_shape(optimizer.init, abstract)
    opt_bytes = _shard_bytes(opt, rules_lib.specs_like(opt, table), mesh)
    tensor = axis_size(mesh, TENSOR)
    c = np.dtype(jax.numpy.dtype(dims.dtype)).itemsize
    block = block_activations_per_token(dims, tensor, seq_len) * tokens * c
    v = dims.vocab_size / tensor if dims.vocab_size % tensor == 0 else dims.vocab_size
    chunk = logprobs.chunk_tokens(dims.vocab_size, logits_mib)
    logits = 3 * min(tokens, chunk or tokens) * v * 4
    if remat:
        acts = dims.n_layers * tokens * dims.d_model * c + 2 * block + logits
    else:
        acts = dims.n_layers * block + logits
    return Plan({a: int(mesh.shape[a]) for a in AXES}, param_bytes, param_bytes, opt_bytes,
                int(acts), tokens, remat)


def read_dims(path: str, dtype: str) -> ModelDims:
    """A model's dims from a Hugging Face config.json file, or a headrace YAML config.

    Raises:
      ConfigError: the file cannot be read or describes no supported model.
    """
    file = pathlib.Path(path)
    if file.suffix == ".json":
        from headrace.formats.hf import spec_from_config
        from headrace.model.dims import RopeScaling

        try:
            spec = spec_from_config(json.loads(file.read_text()), str(file))
        except (OSError, ValueError) as error:
            raise ConfigError(f"{file}: cannot read a model config.json ({error})") from None
        if spec.get("rope_scaling"):
            spec["rope_scaling"] = RopeScaling(**spec["rope_scaling"])
        return dataclasses.replace(ModelDims(**spec), dtype=dtype)
    from headrace.config import load

    config = load(file)
    return ModelDims.from_config(config.model, config.model.vocab_size or 256)


def format_table(plans: list[Plan]) -> str:
    rows = ["mesh (data,fsdp,tensor)  remat  tokens/dev  params  grads  optimizer  activations  "
            "total (GiB per device)"]
    for p in plans:
        m = p.mesh
        rows.append(f"{m['data']:>4},{m['fsdp']:>4},{m['tensor']:>3}  {'block' if p.remat else 'none':>12}"
                    f"  {p.tokens:>10}  {p.params / GiB:6.1f}  {p.grads / GiB:5.1f}  "
                    f"{p.optimizer / GiB:9.1f}  {p.activations / GiB:11.1f}  {p.total / GiB:6.1f}")
    return "\n".join(rows)


def parse_mesh(text: str) -> dict[str, int]:
    """'data=1,fsdp=8,tensor=8' -> sizes.

    Raises:
      ConfigError: not of that form, or an axis other than data, fsdp, tensor.
    """
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in AXES or not value.strip().lstrip("-").isdigit():
            raise ConfigError(f"--mesh {text!r}: expected e.g. data=1,fsdp=8,tensor=8 (axes "
                              f"{', '.join(AXES)}; -1 for the rest of the devices)")
        sizes[name.strip()] = int(value)
    return {a: sizes.get(a, 1) for a in AXES}


def run(config: str, meshes: list[str], tokens: int, seq_len: int, remat: str, dtype: str,
        master_dtype: str, as_json: bool) -> str:
    """The text `headrace plan` prints (a table, or JSON with --json)."""
    import optax

    dims = read_dims(config, dtype)
    plans = []
    for text in meshes or ["data=1,fsdp=1,tensor=1"]:
        mesh = abstract_mesh(parse_mesh(text))
        for choice in ((True, False) if remat == "both" else (remat == "block",)):
            plans.append(plan(dims, mesh, optax.adamw(1e-6), tokens=tokens, seq_len=seq_len,
                              remat=choice, master_dtype=master_dtype))
    if as_json:
        return json.dumps([p.as_dict() for p in plans], indent=1)
    return (f"{config}: {params_lib.count(jax.eval_shape(lambda: params_lib.init(dims, 0)[1])):,}"
            f" parameters, compute {dtype}, master {master_dtype}, AdamW\n" + format_table(plans))
