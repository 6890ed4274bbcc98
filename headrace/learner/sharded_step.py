"""The learner step over a device mesh: `jax.shard_map` forward/backward, optax update under jit.

`ShardedTrainStep` has `train_step.TrainStep`'s interface and semantics (microbatch by microbatch,
gradients accumulated, one optimizer update on each minibatch's last microbatch, the same metrics)
and computes the same update as the single-device step, up to float rounding.

One microbatch is one jitted program (named `sharded_train_step`, so `compiles("train_step")`
counts it) with two parts:

1. `jax.shard_map` over the whole mesh: each device takes its rows of the microbatch (rows split
   over `data` x `fsdp`) and its blocks of the parameters (`rules.py`), runs the forward pass with
   explicit collectives (`forward.py`: per-layer all-gathers over `fsdp`, psums over `tensor`),
   the loss from `headrace.learner.losses`, and `jax.grad`. Gradients leave the shard_map in the
   parameters' own layout: the transpose of each all-gather is a reduce-scatter over `fsdp`, and
   a parameter replicated over an axis the rows are split over gets its gradient summed over it
   (shard_map's transpose of the implicit broadcast is a psum). The loss parts and importance
   sums are psum'd (pmax'd for the ratio max) over (`data`, `fsdp`).
2. Outside the shard_map, under the same jit, on the sharded global arrays: gradient
   accumulation and, on the last microbatch, the optax update. Norms (clip_by_global_norm, the
   metrics) are therefore global; XLA inserts the reductions.

Contract with the batcher: a microbatch's rows must divide by data x fsdp (`ValueError` before
anything is dispatched). The state passed in must be this step's placement (`place`); a state
placed otherwise (fresh from `init_state`, or restored onto other shardings) is placed first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from headrace.config import Config, ConfigError, LearnerConfig
from headrace.learner.batching import TRAIN_FIELDS
from headrace.learner.sharded_forward import ShardedForward, ShardedLayout
from headrace.learner.train_step import RATIO_MAX, Accum, TrainState, TrainStep, loss_terms
from headrace.model import params as params_lib
from headrace.model.lora import LoraSpec
from headrace.model.transformer import ModelDims
from headrace.parallel import multihost
from headrace.parallel import rules as rules_lib
from headrace.parallel.mesh import ROW_AXES, TENSOR, axis_size, make_mesh, row_shards

ROWS = PartitionSpec(ROW_AXES, None)  # a microbatch array [rows, width]
REPLICATED = PartitionSpec()


class ShardedTrainStep(TrainStep):
    """`(state, batch) -> (state, metrics)` on `mesh`; see the module docstring.

    Args:
      graphdef, config, temperature, optimizer, allowed_v: as `train_step.TrainStep`.
      mesh: from `mesh.make_mesh` (axes data, fsdp, tensor).
      dims: the model's sizes (default: read from the model on the first call).
      rules: `config.parallel.rules` overrides of the partition table.
      max_replicated_share: fail (`rules.ReplicationError`) when more of the parameter bytes are
        replicated over fsdp x tensor (None: never).
      remat: each block under `jax.checkpoint` (`model.remat: block`): its gathered parameters
        and intermediates are not kept for the backward pass but recomputed there.

    Attributes (after `place` or the first call):
      plan: {param path: rules.ParamPlan}; report: the `rules.ReplicationReport`;
      state_shardings: the TrainState's NamedShardings; batch_sharding: a microbatch array's.

    Donates `state`. Not thread-safe: one step at a time. A call raises ValueError when a
    microbatch's rows do not divide by data x fsdp (nothing is dispatched); its metrics are
    replicated device scalars.
    """

    name = "sharded_train_step"

    def __init__(self, graphdef, config: LearnerConfig, temperature: float,
                 optimizer: optax.GradientTransformation, allowed_v: np.ndarray | None = None, *,
                 mesh, dims: ModelDims | None = None, rules: Mapping[str, Any] | None = None,
                 max_replicated_share: float | None = rules_lib.DEFAULT_MAX_REPLICATED_SHARE,
                 remat: bool = True):
        super().__init__(graphdef, config, temperature, optimizer,
                         None if allowed_v is None else np.asarray(allowed_v, bool),
                         remat=remat, dims=dims)
        self.mesh = mesh
        self.overrides = dict(rules or {})
        self.max_replicated_share = max_replicated_share
        self.batch_sharding = NamedSharding(mesh, ROWS)
        self._replicated = NamedSharding(mesh, REPLICATED)
        self.plan: dict[str, rules_lib.ParamPlan] | None = None
        self.report: rules_lib.ReplicationReport | None = None
        self.state_shardings = None

    # --- placement -----------------------------------------------------------------------------

    def _setup(self, state: TrainState) -> None:
        if self.plan is not None:
            return
        if self.dims is None:
            self.dims = params_lib.merge(self.graphdef, state.params).dims
        self.plan = rules_lib.plan_params(state.params, self.mesh, self.overrides)
        self.report = rules_lib.replication_report(self.plan, self.mesh, self.max_replicated_share)
        self.state_shardings = self.shardings_for(state)
        self._param_specs = rules_lib.specs_like(state.params, self.plan)
        layout = ShardedLayout.for_model(self.dims, axis_size(self.mesh, TENSOR),
                                         {p: item.spec for p, item in self.plan.items()},
                                         remat=self.remat)
        self.forward = ShardedForward(self.dims, layout, self.config.logits_mib)

    def shardings_for(self, tree: Any) -> Any:
        """NamedShardings for any tree shaped like (parts of) the train state (params, optimizer
        state, a whole TrainState or Accum): parameter-shaped leaves by the rules, others
        replicated. Call after `place` (or pass a state to `place` first)."""
        if self.plan is None:
            raise RuntimeError("ShardedTrainStep.shardings_for: call place(state) first")
        return rules_lib.shardings(self.mesh, rules_lib.specs_like(tree, self.plan))

    def place(self, state: TrainState) -> TrainState:
        """`state` laid out on the mesh by the partition rules. Leaves already placed so are
        returned as they are (their buffers then go with the state into the donating step).

        Raises:
          rules.ReplicationError: too much of the model would be replicated (see `rules`).
          ConfigError: a bad `parallel.rules` override.
        """
        self._setup(state)
        return _to_mesh(state, self.state_shardings)

    def _put(self, arrays: dict[str, Any]) -> dict[str, jax.Array]:
        """A microbatch's arrays on the mesh, rows split over data x fsdp.

        Raises:
          ValueError: the rows do not divide by data x fsdp.
        """
        shape = arrays["tokens"].shape
        processes = jax.process_count()  # each process holds its own rows (multi-host)
        ways = row_shards(self.mesh) // processes
        if shape[0] % ways:
            raise ValueError(
                f"microbatch shape {tuple(shape)}: {shape[0]} rows do not divide by data x fsdp = "
                f"{ways} on mesh {dict(self.mesh.shape)}; the batcher's rows must be multiples of "
                f"{ways} (the learner sets shapes.row_multiple from the mesh)")
        if processes == 1:
            return jax.device_put(arrays, self.batch_sharding)
        rows = (shape[0] * processes, shape[1])
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v, rows)
                for k, v in arrays.items()}

    def _placed(self, state: TrainState) -> TrainState:
        """`state`, placed by the rules unless it is already (the state this step returned, or
        every leaf on its sharding)."""
        if state is self._returned:
            return state
        self._setup(state)
        ok = all(getattr(x, "sharding", None) is not None and x.sharding.is_equivalent_to(s, x.ndim)
                 for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(self.state_shardings)))
        return state if ok else _to_mesh(state, self.state_shardings)

    def _placed_accum(self, acc: Accum) -> Accum:
        return _to_mesh(acc, self.shardings_for(acc))

    # --- the program ---------------------------------------------------------------------------

    def _local_grads(self, params, mb, extras):
        """Inside shard_map: this device's rows and parameter blocks -> gradient blocks, sums."""

        def logprobs(p):
            return self.forward.logprobs(p, mb, self.temperature, self.allowed_v)

        prox = ref_logp = None
        if "anchor" in extras:  # decoupled loss: the proximal policy's log-probs
            prox = jax.lax.stop_gradient(logprobs(extras["anchor"])[0])
        if "ref" in extras:
            ref_logp = logprobs(extras["ref"])[0]

        def loss_fn(p):
            logp, entropy = logprobs(p)
            total, sums = loss_terms(logp, entropy, mb, self.config, prox, ref_logp)
            # The global loss: every device's rows. Its gradient w.r.t. this device's blocks.
            return jax.lax.psum(total, ROW_AXES), sums

        grads, sums = jax.grad(loss_fn, has_aux=True)(params)
        sums = {k: (jax.lax.pmax if k == RATIO_MAX else jax.lax.psum)(v, ROW_AXES)
                for k, v in sums.items()}
        return grads, sums

    def grads_and_sums(self, params, mb, anchor, ref_params):
        """(gradient, sums) of one microbatch over the mesh (one shard_map)."""
        extras = {k: v for k, v in (("anchor", anchor), ("ref", ref_params)) if v is not None}
        specs = self._param_specs
        return jax.shard_map(
            self._local_grads, mesh=self.mesh,
            in_specs=(specs, {k: ROWS for k in mb}, {k: specs for k in extras}),
            out_specs=(specs, REPLICATED))(params, mb, extras)

    def _compile(self, carry):
        carry_shardings = self.shardings_for(carry)
        rep = self._replicated
        mb_shardings = {k: self.batch_sharding for k in TRAIN_FIELDS}
        step = jax.jit(self._program(), donate_argnums=0,
                       in_shardings=(carry_shardings, mb_shardings, rep, rep, rep),
                       out_shardings=(carry_shardings, rep))
        if jax.process_count() == 1:
            return step
        return multihost.CompiledTogether(step, self.name)  # no process runs ahead into Gloo

    def program_text(self, state: TrainState, arrays: dict[str, Any]) -> str:
        """The StableHLO text of the microbatch program for `state` and one microbatch's arrays
        (inspection: which collectives it runs). Traces and lowers; compiles nothing."""
        state = self._placed(state)
        self._prepare(state)
        arrays = {k: arrays[k] for k in TRAIN_FIELDS}
        flag = np.bool_(True)
        return self._step.lower((state, self._acc), arrays, flag, flag, np.float32(1)).as_text()


def _to_mesh(tree: Any, shardings: Any) -> Any:
    """`tree` laid out by `shardings`. With several processes every process passes the same
    values (host data, or arrays already global): each builds its own shards from them."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, sharding):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if x.sharding.is_equivalent_to(sharding, x.ndim):
                return x
            return jax.jit(lambda a: a, out_shardings=sharding)(x)
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


def learner_step(config: Config, graphdef, optimizer: optax.GradientTransformation,
                 allowed_v: np.ndarray | None = None) -> tuple[TrainStep, int]:
    """The learner's step for `config.parallel`, and the row multiple its microbatches need.

    The plain single-device `TrainStep` unless the mesh spans more than one device; then a
    `ShardedTrainStep` over every device (`jax.devices()`: all hosts' with `jax.distributed`).

    Raises:
      ConfigError: the mesh does not fit the devices.
    """
    lc, temperature = config.learner, config.sampling.temperature
    remat = config.model.remat == "block"  # `auto`: none on one device, block on a mesh
    if not config.parallel.sharded:  # LoRA (`model.lora`) runs here only (config refuses a mesh)
        return TrainStep(graphdef, lc, temperature, optimizer, allowed_v, remat=remat,
                         lora=LoraSpec.of(config.model.lora)), 1
    mesh = make_mesh(config.parallel.mesh)
    local = jax.local_device_count()
    if jax.process_count() > 1 and local % axis_size(mesh, TENSOR):
        raise ConfigError(f"parallel.mesh={config.parallel.mesh}: tensor="
                          f"{axis_size(mesh, TENSOR)} must divide each process's {local} devices "
                          "(a process's rows must live on its own devices)")
    if mesh.size == 1:
        return TrainStep(graphdef, lc, temperature, optimizer, allowed_v, remat=remat), 1
    step = ShardedTrainStep(graphdef, lc, temperature, optimizer, allowed_v, mesh=mesh,
                            rules=config.parallel.rules, remat=config.model.remat != "none",
                            max_replicated_share=config.parallel.max_replicated_share)
    return step, row_shards(mesh) // jax.process_count()  # this process's rows


def checks_mesh_at_start(config: Config) -> bool:
    """Whether the launcher checks `parallel.mesh` before anything starts (`check_mesh`): a
    sharded learner of one process; several processes check their own devices when they start."""
    return config.parallel.sharded and config.parallel.processes == 1


def check_mesh(config: Config, dims: ModelDims) -> None:
    """Refuses, before any process starts, a `parallel.mesh` this machine's devices or the model
    cannot take (the learner process would otherwise fail alone). Shapes only: nothing is built.

    Raises:
      ConfigError: the mesh does not fit the devices, or leaves too much of the model replicated.
    """
    if not checks_mesh_at_start(config):
        return
    mesh = make_mesh(config.parallel.mesh)
    if mesh.size == 1:
        return
    abstract = jax.eval_shape(lambda: params_lib.init(dims, 0)[1])
    plan = rules_lib.plan_params(abstract, mesh, config.parallel.rules)
    rules_lib.replication_report(plan, mesh, config.parallel.max_replicated_share)
