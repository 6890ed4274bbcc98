"""The sharded step computes the single-device step's update, really shards, and compiles once.

On 8 simulated CPU devices (tests/conftest.py sets XLA_FLAGS) for meshes (data, fsdp, tensor) =
(8,1,1), (1,8,1), (1,4,2), (2,2,2), against the plain jitted `TrainStep` on one device, with a
step of two minibatches (three microbatches, two optimizer updates): `ppo_clip` on all four,
`decoupled` with the KL term on the two meshes with every axis in use or tensor > 1, and a model
whose kv heads, vocabulary and MLP width `tensor` = 4 does not divide on (1,2,4).

What "the same update" is checked as, in float32:
- every metric (loss parts, global grad norm, update norm, importance sums): rtol 1e-5;
- Adam's first and second moments, i.e. each update's clipped gradient and its square: after the
  first update rtol 1e-5 plus 1e-5 of the leaf's largest entry, after the second 1e-4 of it (its
  gradient is taken at parameters that already differ as below). This is what catches a gradient
  wrongly scaled or reduced: Adam's update itself is invariant to the gradient's scale;
- the parameters, by an error analysis rather than a tolerance on their difference: Adam turns a
  rounding-level difference in a small gradient into a visible step (m / sqrt(v) is scale-free),
  so two correct implementations can differ by up to lr per update on such entries, whatever the
  CPU. Each state's parameters are instead checked against the Adam update of its *own* moments,
  recomputed in float64 (`tests.adam_check.assert_params_follow_moments`): p2 = p0 - lr (u1 + u2) with
  u = m_hat / (sqrt(v_hat) + eps), bias corrections taken in float32 as optax takes them (in
  float64 they differ by up to 1e-5 relative: 0.999 is not a float32). The float32 step rounds
  each u in about six operations and each parameter in two additions, so every entry must agree
  to 16 eps32 (|p0| + lr (|u1| + |u2|)), about twice that count of roundings (measured: at most
  1.4 of those units on one CPU, over every entry of two meshes). Together with the moments
  (the gradients, above) this pins the update on every entry, none left to a looser bound.
"""

from __future__ import annotations

import collections
import functools

import jax
import numpy as np
import pytest

from headrace.learner.batching import Batch
from headrace.learner.sharded_forward import ShardedLayout
from headrace.learner.sharded_step import ShardedTrainStep
from headrace.learner.train_step import init_state, make_optimizer, make_train_step
from headrace.model import params as params_lib
from headrace.model.transformer import ModelDims
from headrace.parallel import rules
from headrace.parallel.mesh import make_mesh
from tests.adam_check import assert_moments, assert_params_follow_moments
from tests.parallel.helpers import DIMS, learner_config, make_batch

MESHES = [(8, 1, 1), (1, 4, 2), (2, 2, 2)]  # data alone; fsdp with tensor; all three
_events: collections.Counter[tuple[str, str]] = collections.Counter()


def _listen(event: str, duration: float, **kwargs) -> None:
    if event in ("/jax/core/compile/jaxpr_trace_duration",
                 "/jax/core/compile/backend_compile_duration"):
        _events[(event.rsplit("/", 1)[1], str(kwargs.get("fun_name", "")))] += 1


jax.monitoring.register_event_duration_secs_listener(_listen)


def _programs(name: str = "sharded_train_step") -> int:
    return sum(n for (_, fun), n in _events.items() if name in fun)


@functools.cache
def _model(dims=DIMS):
    graphdef, params = params_lib.init(dims, 0)
    return graphdef, jax.device_get(params)


def _first_minibatch(batch: Batch) -> Batch:
    mbs = [mb for mb in batch.microbatches if mb.minibatch == 0]
    return Batch(mbs, 1, 0, 0, 0, 0)


@functools.cache
def _reference(kind: str, kl: float, dims=DIMS):
    """Single-device step: state after the first update alone, after the step, and metrics."""
    graphdef, params = _model(dims)
    config = learner_config(kind, kl)
    optimizer = make_optimizer(config.optimizer)
    step = make_train_step(graphdef, config, 1.0, optimizer)
    batch = make_batch(vocab=dims.vocab_size)
    half, _ = step(init_state(params, optimizer, kl), _first_minibatch(batch))
    half = jax.device_get(half)
    state, metrics = step(init_state(params, optimizer, kl), batch)
    return half, jax.device_get(state), jax.device_get(metrics)


def assert_same_update(got_half, got, reference, metrics, lr: float, b1: float) -> None:
    """`got_half`: the sharded state after the first minibatch alone; `got`: after the step."""
    half, want, want_metrics = reference
    assert set(metrics) == set(want_metrics)
    for key, value in want_metrics.items():
        np.testing.assert_allclose(np.asarray(metrics[key]), value, rtol=1e-5, atol=1e-6,
                                   err_msg=key)
    got, got_half = jax.device_get((got, got_half))
    assert int(got.step) == int(want.step) == 2
    # The first update's gradient, exactly; the second's also carries the first update's
    # rounding-level differences (below) through the forward pass.
    assert_moments(got_half, half, 1e-5)
    assert_moments(got, want, 1e-4)
    initial = params_lib.flatten(jax.device_get(_model(_dims_of(want))[1]))
    for state, first in ((want, half), (got, got_half)):
        assert_params_follow_moments(initial, (first, state), lr, b1)
    for path, a in params_lib.flatten(want.params).items():  # and so within lr per update
        b = params_lib.flatten(got.params)[path]
        np.testing.assert_array_less(np.abs(b - a), 2 * lr + 1e-6, err_msg=path)


def _dims_of(state) -> ModelDims:
    """The test model whose parameters `state` holds (by the embedding's shape)."""
    vocab = params_lib.flatten(state.params)["embed.embedding"].shape[0]
    return DIMS if vocab == DIMS.vocab_size else _TENSOR_DIMS


_TENSOR_DIMS = ModelDims(vocab_size=66, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, d_ff=90)


def _step_and_check(step, state, kind, kl, dims=DIMS):
    """Runs the reference batch's first minibatch alone, then the whole step; checks both."""
    batch = make_batch(vocab=dims.vocab_size)
    graphdef, params = _model(dims)
    fresh = step.place(init_state(params, step.optimizer, kl))
    half, _ = step(fresh, _first_minibatch(batch))
    state, metrics = step(state, batch)
    assert_same_update(half, state, _reference(kind, kl, dims), metrics,
                       step.config.optimizer.lr, step.config.optimizer.b1)
    return state, metrics


def _run(mesh_shape, kind="ppo_clip", kl=0.0, dims=DIMS, **kwargs):
    graphdef, params = _model(dims)
    config = learner_config(kind, kl)
    optimizer = make_optimizer(config.optimizer)
    mesh = make_mesh(dict(zip(("data", "fsdp", "tensor"), mesh_shape)))
    step = ShardedTrainStep(graphdef, config, 1.0, optimizer, mesh=mesh, **kwargs)
    state = step.place(init_state(params, optimizer, kl))
    return config, step, state


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: "x".join(map(str, m)))
def test_ppo_step_equals_single_device_and_shards(mesh_shape):
    config, step, state = _run(mesh_shape)
    data, fsdp, tensor = mesh_shape
    # Really sharded: parameters and optimizer state per device, from the live arrays.
    params_b = rules.max_bytes_per_device(state.params)
    opt_b = rules.max_bytes_per_device(state.opt_state)
    total = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
    assert params_b + opt_b <= 1.1 * total / (fsdp * tensor), (params_b, opt_b, total)
    assert step.report.share < 0.01

    state, metrics = _step_and_check(step, state, "ppo_clip", 0.0)
    # Manual collectives: per-layer gathers over fsdp (forward, and again in the rematerialised
    # backward), their transposes reduce-scatters; psums (all-reduces) for tensor and the loss.
    text = step.program_text(state, make_batch().microbatches[0].arrays)
    by_fsdp = sum("fsdp" in str(item.spec) for item in step.plan.values())
    assert by_fsdp == 2 + 7 * DIMS.n_layers
    assert text.count("stablehlo.reduce_scatter") >= by_fsdp
    assert text.count("stablehlo.all_gather") >= 2 * by_fsdp - 2
    assert "stablehlo.all_reduce" in text
    # The same shapes again: nothing traced or compiled.
    before = _programs()
    assert before >= 1
    state, metrics = step(state, make_batch(seed=1))
    jax.block_until_ready(state)
    assert _programs() == before
    assert int(state.step) == 4 and np.isfinite(float(metrics["loss/total"]))


@pytest.mark.timeout(240)
def test_decoupled_with_kl_equals_single_device():
    # The loss changes, not the layout: one mesh with every axis (the PPO test covers the rest).
    config, step, state = _run((2, 2, 2), "decoupled", 0.1)
    state, metrics = _step_and_check(step, state, "decoupled", 0.1)
    assert "loss/kl" in metrics


@pytest.mark.timeout(240)
def test_dimensions_tensor_does_not_divide_run_whole_with_the_same_update():
    # tensor=4: 2 kv heads (each device picks its query heads' kv head from all of them),
    # vocabulary 66 and hidden width 90 (embedding, logits and MLP run whole on every device).
    dims = _TENSOR_DIMS
    config, step, state = _run((1, 2, 4), dims=dims, max_replicated_share=None)
    assert step.forward.layout == ShardedLayout(4, vocab=False, heads=True, kv_heads=False, mlp=False,
                                               remat=True)
    notes = {path: notes for path, _, _, notes in step.report.entries}
    assert "not divisible by tensor=4" in notes["embed.embedding"][0]
    assert "layers.0.mlp.down.kernel" in notes and "layers.0.attn.q.kernel" not in notes
    with pytest.raises(rules.ReplicationError, match="embed.embedding"):
        rules.replication_report(step.plan, step.mesh, max_share=0.05)
    _step_and_check(step, state, "ppo_clip", 0.0, dims)


@pytest.mark.timeout(60)
def test_rows_that_do_not_divide_are_refused_before_dispatch():
    _, step, state = _run((2, 2, 2))
    with pytest.raises(ValueError, match="do not divide by data x fsdp = 4"):
        step(state, make_batch(rows=6))
    assert all(not x.is_deleted() for x in jax.tree.leaves(state))  # nothing was donated
