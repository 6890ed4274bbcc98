"""The shard_map building blocks against their one-device definitions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from headrace.learner import losses
from headrace.learner.sharded_forward import relayout, vocab_logprobs
from headrace.parallel.mesh import make_mesh


@pytest.mark.parametrize("allowed", [False, True])
def test_vocab_parallel_logprobs_match_the_full_softmax(allowed):
    mesh = make_mesh({"fsdp": 2, "tensor": 4})
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 3, (4, 5, 32)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 32, (4, 5)), jnp.int32)
    allowed_v = (rng.random(32) < 0.6) if allowed else None
    if allowed:
        targets = jnp.asarray(np.flatnonzero(allowed_v)[np.asarray(targets) % allowed_v.sum()])
    cotangent = jnp.asarray(rng.normal(size=(2, 4, 5)), jnp.float32)

    def objective(fn):
        def f(x):
            logp, entropy = fn(x)
            return jnp.sum(logp * cotangent[0]) + jnp.sum(entropy * cotangent[1]), (logp, entropy)
        return f

    want_grad, want = jax.grad(objective(
        lambda x: losses.token_logprobs(x, targets, 0.7, allowed_v)), has_aux=True)(logits)

    def local(x, t, c):  # this device: its rows (fsdp) and vocabulary block (tensor)
        def f(x):
            logp, entropy = vocab_logprobs(x, t, 0.7, allowed_v)
            part = jnp.sum(logp * c[0]) + jnp.sum(entropy * c[1])
            return jax.lax.psum(part, "fsdp"), (logp, entropy)

        grad, out = jax.grad(f, has_aux=True)(x)
        return out, grad

    rows = P("fsdp", None)
    out, grad = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(P("fsdp", None, "tensor"), rows, P(None, "fsdp", None)),
        out_specs=((rows, rows), P("fsdp", None, "tensor"))))(logits, targets, cotangent)
    np.testing.assert_allclose(out[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[1], want[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)


def test_relayout_gathers_blocks_in_mesh_order_and_slices_for_tensor():
    mesh = make_mesh({"fsdp": 2, "tensor": 4})
    x = jnp.arange(16.0 * 3).reshape(16, 3)

    def local(block):
        whole = relayout(block, P(("fsdp", "tensor"), None), (None, None))
        mine = relayout(block, P(("fsdp", "tensor"), None), ("tensor", None))
        return whole, mine

    whole, mine = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=P(("fsdp", "tensor"), None),
        out_specs=(P(), P("tensor", None)), check_vma=False))(x)
    np.testing.assert_array_equal(whole, x)
    np.testing.assert_array_equal(mine, x)  # tensor device i holds rows 4i..4i+3 of the whole
