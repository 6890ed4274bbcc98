"""Memory for big models: fp32 master weights under a bf16 model, and per-block remat.

On one device and on the simulated (2, 2, 2) mesh (conftest forces 8 CPU devices).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from headrace.learner.sharded_step import ShardedTrainStep
from headrace.learner.train_step import TrainStep, compute_params, init_state
from headrace.model import params as params_lib
from headrace.parallel.mesh import make_mesh
from tests.parallel.helpers import DIMS, learner_config, make_batch

BF16 = dataclasses.replace(DIMS, dtype="bfloat16")
MESH = {"data": 2, "fsdp": 2, "tensor": 2}
# bf16 unit roundoff (round to nearest, 8 significant bits).
U_BF16 = 2.0 ** -8


def _bf16_tolerance(dims) -> float:
    """Norm-wise relative error expected of a gradient computed in bf16 instead of fp32.

    First-order error analysis: each bf16 rounding on the path from the parameters to the
    gradient multiplies a value by (1 + d), |d| <= u. Counting them on the longest path: the
    parameter cast, then per block the attention norm, q/k/v, RoPE, the probabilities, probs @ v,
    o, the residual, the MLP norm, gate/up, silu * up, down and the residual (12), then the final
    norm and the logits: k = 3 + 12 L forward, as many backward. Independent roundings (variance
    u^2 / 3 each) add up to a relative error of about sqrt(2 k / 3) u; the bound allows 3 of those
    standard deviations. Errors adding up in the worst case (2 k u) would be 6 times wider.
    """
    k = 2 * (3 + 12 * dims.n_layers)
    return 3 * math.sqrt(k / 3) * U_BF16


DEEP = dataclasses.replace(DIMS, n_layers=6)  # remat saves all blocks but the one being redone


@functools.cache
def _master(dims=DIMS):
    """fp32 parameters, the same for the fp32 and the bf16 model."""
    return jax.device_get(params_lib.init(dims, 0)[1])


def _step(dims, mesh, optimizer, remat=False, logits_mib=0, kind="ppo_clip"):
    graphdef = params_lib.graphdef(dims)
    config = dataclasses.replace(learner_config(kind), logits_mib=logits_mib)
    if mesh is None:
        return TrainStep(graphdef, config, 1.0, optimizer, remat=remat, dims=dims)
    return ShardedTrainStep(graphdef, config, 1.0, optimizer, mesh=make_mesh(mesh), dims=dims,
                            remat=remat)


def _flat(tree):
    return {k: np.asarray(v, np.float32) for k, v in params_lib.flatten(jax.device_get(tree)).items()}


def _norm(flat):
    return math.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in flat.values()))


CASES = [(None, (2, 1)), (MESH, (1,)), (MESH, (1, 1))]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh, plan", CASES, ids=["one_device", "2x2x2", "2x2x2_two_calls"])
def test_bf16_update_is_the_fp32_update_up_to_bf16_rounding_on_a_fp32_master(mesh, plan):
    # SGD with momentum: the first update is -lr * gradient exactly, so the update compares the
    # gradients; the momentum trace is optimizer state shaped like the parameters.
    # The objective is smooth (REINFORCE, `loss.kind: none`, and the entropy bonus), so the
    # first-order error analysis of `_bf16_tolerance` holds. PPO's clip and dual clip are not:
    # a token whose ratio lies within rounding of a clip bound loses or gains its whole gradient
    # when bf16 (or only another reduction order) moves it across. This batch has one such token
    # (fp32 ratio 2.9965 against the dual clip's 3, advantage -1.7; 3.016 in bf16 on the mesh):
    # with `ppo_clip` the mesh's bf16 update was 46 % off the fp32 one while every log-prob
    # agreed within 0.021.
    # Updates ~1e-6 of a weight: far above a fp32 ulp (6e-8 relative), far below half a bf16 ulp
    # (2e-3 relative): a bf16 master would hardly move.
    lr = 1e-4
    optimizer = optax.sgd(lr, momentum=0.9)
    batch = make_batch(plan=plan)
    p0 = _flat(_master())
    updates = {}
    for dims in (DIMS, BF16):
        step = _step(dims, mesh, optimizer, kind="none")
        state = init_state(_master(), optimizer, 0.0, "float32")
        state, metrics = step(state, batch)
        assert int(state.step) == len(plan) and float(metrics["learner/skipped_nonfinite"]) == 0
        for leaf in jax.tree.leaves((state.params, state.opt_state)):
            assert leaf.dtype == jnp.float32 or not jnp.issubdtype(leaf.dtype, jnp.floating)
        published = jax.tree.leaves(compute_params(state.params, dims))
        assert {leaf.dtype for leaf in published} == {jnp.dtype(dims.dtype)}
        new = _flat(state.params)
        updates[dims.dtype] = {k: new[k] - p0[k] for k in p0}
        if dims is BF16:
            # The update survives in the master; rounded to bf16 it would be lost almost entirely:
            # a weight's bf16 value changes only when a rounding boundary lies within its
            # update, with probability |update| / (bf16 spacing at the weight), on average
            # `expected` (0.006 after one update here, 0.011 after two).
            moved32 = np.concatenate([(u != 0).ravel() for u in updates["float32"].values()])
            moved = np.concatenate([(new[k] != p0[k]).ravel() for k in p0])[moved32].mean()
            as_bf16 = np.concatenate([
                (jnp.asarray(new[k], jnp.bfloat16) != jnp.asarray(p0[k], jnp.bfloat16)).ravel()
                for k in p0])[moved32].mean()
            spacing = {k: 2.0 ** (np.floor(np.log2(np.abs(p0[k]) + 1e-30)) - 7) for k in p0}
            expected = np.concatenate([np.minimum(np.abs(new[k] - p0[k]) / spacing[k], 1).ravel()
                                       for k in p0])[moved32].mean()
            assert moved32.mean() > 0.5 and moved > 0.95, moved
            assert as_bf16 < 0.05 and as_bf16 < 2 * expected, (as_bf16, expected)
    u32, u16 = updates["float32"], updates["bfloat16"]
    error = _norm({k: u16[k] - u32[k] for k in u32}) / _norm(u32)
    tolerance = _bf16_tolerance(DIMS)
    assert 0 < error < tolerance, (error, tolerance)


def _grads(step, batch_arrays, dims=DEEP, sums=False):
    state = init_state(_master(dims), step.optimizer, 0.0)
    state = step._placed(state)
    mb = step._put(batch_arrays)
    out = jax.jit(lambda p: step.grads_and_sums(p, mb, None, None))(state.params)
    return out if sums else out[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", [None, MESH], ids=["one_device", "2x2x2"])
def test_remat_gives_the_same_gradient(mesh):
    optimizer = optax.sgd(1e-3)
    arrays = make_batch(rows=8, width=128, plan=(1,)).microbatches[0].arrays
    grads = {}
    for remat in (False, True):
        grads[remat] = _flat(_grads(_step(DEEP, mesh, optimizer, remat), arrays))
    # The same operations recomputed: only XLA's fusion choices differ, i.e. the order of fp32
    # sums (a few ulps of the largest terms); relative to the gradient's norm well below 1e-5.
    scale = _norm(grads[False])
    for path, g in grads[False].items():
        np.testing.assert_allclose(grads[True][path], g, rtol=0, atol=1e-5 * scale, err_msg=path)


WIDE = dataclasses.replace(DIMS, vocab_size=4096)  # 1 MiB of float32 logits: 64 tokens


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", [None, MESH], ids=["one_device", "2x2x2"])
def test_logits_in_chunks_give_the_same_loss_and_gradient(mesh):
    # 8 rows of 90: 712 next-token positions, 12 chunks of 60 (8 padded) on one device; on the
    # mesh 2 rows a device, 3 chunks of 60 (2 padded), each of the two vocabulary halves.
    optimizer = optax.sgd(1e-3)
    arrays = make_batch(rows=8, width=90, vocab=WIDE.vocab_size, plan=(1,)).microbatches[0].arrays
    out = {mib: _grads(_step(WIDE, mesh, optimizer, logits_mib=mib), arrays, WIDE, sums=True)
           for mib in (0, 1)}
    (whole, whole_sums), (chunked, chunked_sums) = out[0], out[1]
    # Each token's log-softmax is its own: the loss terms agree to fp32 rounding. The gradient of
    # the projection is summed chunk by chunk, then over chunks: fp32 sums in another order
    # (a few ulps of the largest terms), relative to the gradient's norm well below 1e-5.
    for key in ("loss/total", "loss/pg", "loss/entropy", "is/rho"):
        np.testing.assert_allclose(float(chunked_sums[key]), float(whole_sums[key]), rtol=1e-5,
                                   atol=1e-7, err_msg=key)
    whole, chunked = _flat(whole), _flat(chunked)
    scale = _norm(whole)
    for path, g in whole.items():
        np.testing.assert_allclose(chunked[path], g, rtol=0, atol=1e-5 * scale, err_msg=path)


@pytest.mark.timeout(300)
def test_logits_in_chunks_lower_the_compiled_steps_temp_bytes():
    # 4 rows of 256 at a 16,384-token vocabulary: 64 MiB of float32 logits, kept with their
    # log-softmax and gradient (~3x) when whole; in chunks of 4 MiB the loop keeps one chunk's.
    dims = dataclasses.replace(DIMS, vocab_size=16384, n_layers=1)
    optimizer = optax.sgd(1e-3)
    arrays = make_batch(rows=4, width=256, vocab=dims.vocab_size, plan=(1,)).microbatches[0].arrays
    temp = {}
    for mib in (0, 4):
        step = _step(dims, None, optimizer, logits_mib=mib)
        state = init_state(_master(dims), optimizer, 0.0)
        temp[mib] = step.compiled(state, arrays).memory_analysis().temp_size_in_bytes
    assert temp[0] > 3 * 64 * 2 ** 20 * 0.9 and temp[4] < 0.25 * temp[0], temp


@pytest.mark.timeout(300)
def test_remat_lowers_the_compiled_steps_temp_bytes():
    """Six blocks: with remat the backward pass keeps each block's input and one block's
    intermediates at a time, without it all six blocks' (measured: 16.8 vs 56 MiB). Under
    XLA:CPU's default concurrency-optimised scheduler the two were 100 vs 103 MiB (the
    recomputation scheduled early); conftest asks for the memory scheduler, as headrace does
    (`headrace.xla_flags`)."""
    optimizer = optax.sgd(1e-3)
    arrays = make_batch(rows=8, width=128, plan=(1,)).microbatches[0].arrays
    temp = {}
    for remat in (False, True):
        step = _step(DEEP, None, optimizer, remat)
        state = init_state(_master(DEEP), optimizer, 0.0)
        temp[remat] = step.compiled(state, arrays).memory_analysis().temp_size_in_bytes
    assert temp[True] < 0.6 * temp[False], temp


@pytest.mark.timeout(300)
@pytest.mark.parametrize("remat", [True, False], ids=["remat", "no_remat"])
def test_plan_matches_the_placed_state_and_bounds_the_compiled_temp_bytes(remat):
    from headrace.parallel import plan as plan_lib
    from headrace.parallel import rules

    optimizer = optax.adamw(1e-3)
    step = _step(DEEP, MESH, optimizer, remat)
    state = step.place(init_state(_master(DEEP), optimizer, 0.0))
    rows, width = 8, 128
    arrays = make_batch(rows=rows, width=width, plan=(1,)).microbatches[0].arrays
    temp = step.compiled(state, arrays).memory_analysis().temp_size_in_bytes
    got = plan_lib.plan(DEEP, plan_lib.abstract_mesh(MESH), optimizer, remat=remat,
                        tokens=rows * width // 4, seq_len=width)  # rows over data x fsdp = 4
    # Parameters and optimizer state: exact, the largest device's shards.
    assert got.params == rules.max_bytes_per_device(state.params)
    assert got.optimizer == rules.max_bytes_per_device(state.opt_state)
    # Activations: a first-order count of the tensors the backward pass keeps; XLA fuses some
    # away and adds its own scratch (gathered parameters, masks, collectives' buffers), so only
    # the order of magnitude is asserted: within a factor of 3 of the compiled temp bytes.
    assert temp / 3 < got.activations < 3 * temp, (got.activations, temp)
