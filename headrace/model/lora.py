"""Low-rank adapters (LoRA; Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models").

A targeted projection's kernel W [in, out] runs as W + scale * A @ B, with A [in, r], B [r, out] and
scale = alpha / r. `forward` (`transformer.py`) applies an adapter tree on the fly,
x @ W + scale * (x @ A) @ B, so the learner differentiates the adapters alone (no gradient of W
is formed); an actor instead merges the adapters into its copy of the base once per version
(`Merger`, one jitted program), so its sampler runs plain weights.

The adapter tree mirrors the parameter tree: `{"layers": {i: {"attn": {"q": {"lora_a": A,
"lora_b": B}}}}}`; its flat wire form is `layers.<i>.attn.q.lora_a` / `.lora_b`, so a published
LoRA version is recognisable by its keys alone. Targets are named as headrace names the
projections: q, k, v, o (attention), gate, up, down (feed-forward).

Initialisation follows the paper and PEFT: A uniform in +-1/sqrt(in) (PEFT's Kaiming-uniform with
a = sqrt(5)), B zero, so a fresh adapter leaves the model exactly as it was.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from headrace.formats import peft
from headrace.formats.peft import AdapterError, check, is_adapters  # noqa: F401 (re-exported)
from headrace.model import params as params_lib

# headrace target name -> the projection's path inside a layer
TARGETS = {"q": "attn.q", "k": "attn.k", "v": "attn.v", "o": "attn.o",
           "gate": "mlp.gate", "up": "mlp.up", "down": "mlp.down"}
A, B = peft.LORA_A, peft.LORA_B  # the wire's key suffixes


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Which projections carry adapters, their rank and their scale (alpha / rank)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, config) -> LoraSpec | None:
        """The spec of a `model.lora` config section (`config.LoraConfig`); None when off."""
        if not config.rank:
            return None
        return cls(config.rank, float(config.alpha), tuple(config.targets))


def _kernels(base: Any, spec: LoraSpec, n_layers: int):
    """(layer, target path, kernel) of every adapted projection in the (possibly abstract) tree."""
    for i in range(n_layers):
        layer = base["layers"][i]
        for name in spec.targets:
            part, proj = TARGETS[name].split(".")
            yield i, TARGETS[name], layer[part][proj]["kernel"]


def init(base: Any, spec: LoraSpec, seed: int, dtype=jnp.float32) -> dict:
    """A fresh adapter tree for the parameter tree `base` (arrays or `jax.ShapeDtypeStruct`s):
    A uniform in +-1/sqrt(in), B zero."""
    root = jax.random.key(seed)
    tree: dict = {"layers": {}}
    for n, (i, path, kernel) in enumerate(_kernels(base, spec, len(base["layers"]))):
        d_in, d_out = kernel.shape
        bound = 1.0 / np.sqrt(d_in)
        part, proj = path.split(".")
        node = tree["layers"].setdefault(i, {}).setdefault(part, {})
        a = jax.random.uniform(jax.random.fold_in(root, n), (d_in, spec.rank), dtype, -bound, bound)
        node[proj] = {A: a, B: jnp.zeros((spec.rank, d_out), dtype)}
    return tree


def shapes(base: Any, spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """{flat key: shape} of the adapters of `base` (the wire's keys)."""
    out = {}
    for i, path, kernel in _kernels(base, spec, len(base["layers"])):
        d_in, d_out = kernel.shape
        out[f"layers.{i}.{path}.{A}"] = (d_in, spec.rank)
        out[f"layers.{i}.{path}.{B}"] = (spec.rank, d_out)
    return out


@functools.partial(jax.jit, static_argnums=(2,))
def _merged_kernels(kernels: dict, adapters: dict, scale: float) -> dict:
    return {path: (jnp.asarray(w, jnp.float32)
                   + scale * (jnp.asarray(adapters[path][A], jnp.float32)
                              @ jnp.asarray(adapters[path][B], jnp.float32))).astype(w.dtype)
            for path, w in kernels.items()}


def _by_path(base: Any, adapters: dict, spec: LoraSpec) -> tuple[dict, dict]:
    kernels, pairs = {}, {}
    for i, path, kernel in _kernels(base, spec, len(base["layers"])):
        key = f"layers.{i}.{path}"
        part, proj = path.split(".")
        kernels[key] = kernel
        pairs[key] = adapters["layers"][i][part][proj]
    return kernels, pairs


def merge(base: Any, adapters: dict, spec: LoraSpec) -> Any:
    """The parameter tree with every adapted kernel replaced by W + scale * A @ B (float32 sum,
    cast to W's dtype); the other leaves are `base`'s own arrays (shared, not copied). One jitted
    program per model, whatever the version."""
    kernels, pairs = _by_path(base, adapters, spec)
    merged = _merged_kernels(kernels, pairs, spec.scale)
    flat = params_lib.flatten(base)
    flat.update({f"{key}.kernel": value for key, value in merged.items()})
    return params_lib.unflatten(flat)


class Merger:
    """An actor's view of a LoRA run's weights: its fixed base (on device) and, per published
    version, that version's adapters merged into it.

    `__call__(flat)` checks the adapters' keys and shapes, copies them to the device and returns
    the merged parameter tree (the base is never modified; the actor holds it plus one merged
    copy of the adapted kernels).
    """

    def __init__(self, base: Any, spec: LoraSpec):
        self.base = base
        self.spec = spec
        self.expected = shapes(base, spec)

    def __call__(self, flat: dict[str, np.ndarray], where: str = "published weights") -> Any:
        check(flat, self.expected, where)
        return merge(self.base, params_lib.from_host(flat), self.spec)


def wire_bytes(flat: dict[str, Any]) -> int:
    """Bytes of a flat weights mapping's arrays (what a publish moves)."""
    return int(sum(np.asarray(v).nbytes for v in flat.values()))
