"""`headrace.model.logprobs.chunked`: the logits a chunk at a time, chunks without a loss token
skipped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from headrace.model.logprobs import chunked


def _fn(calls):
    def fn(x, y):  # stands in for the projection and log-softmax: per token, [1, n] each
        jax.debug.callback(lambda: calls.append(1))
        return jnp.tanh(x).sum(-1) * 0.5 + y, jnp.cos(x[..., 0])
    return fn


@pytest.mark.timeout(120)
def test_only_chunks_with_a_marked_token_run_and_marked_results_are_exact():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 10, 4)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 5, (3, 10)), jnp.float32)
    on = np.zeros((3, 10), bool)
    on[[0, 1, 1, 2, 2], [9, 0, 5, 3, 8]] = True  # 5 marked of 30: 2 chunks of 4 once sorted
    whole = _fn([])(x, y)
    calls = []
    logp, entropy = jax.jit(lambda x, y, on: chunked(_fn(calls), x, y, 4, on))(x, y, on)
    jax.effects_barrier()
    assert len(calls) == 2  # 8 chunks of 4 (the last padded); 6 skipped
    for got, want in ((logp, whole[0]), (entropy, whole[1])):
        np.testing.assert_array_equal(np.asarray(got)[on], np.asarray(want)[on])
    # Without a mask every chunk runs and every result is the token's own.
    calls.clear()
    logp, _ = jax.jit(lambda x, y: chunked(_fn(calls), x, y, 4))(x, y)
    jax.effects_barrier()
    assert len(calls) == 8
    np.testing.assert_array_equal(np.asarray(logp), np.asarray(whole[0]))


@pytest.mark.timeout(120)
def test_the_gradient_through_skipped_chunks_is_the_whole_arrays_on_marked_tokens():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 16, 3)), jnp.float32)
    y = jnp.zeros((2, 16), jnp.float32)
    on = jnp.asarray(rng.random((2, 16)) < 0.2)
    weight = jnp.where(on, jnp.asarray(rng.normal(size=(2, 16)), jnp.float32), 0.0)

    def loss(x, chunk):
        fn = lambda x, y: (jnp.tanh(x).sum(-1) + y, jnp.cos(x[..., 0]))  # noqa: E731
        logp, entropy = chunked(fn, x, y, chunk, on if chunk else None)
        return jnp.sum((logp + 0.1 * entropy) * weight)

    whole = jax.grad(loss)(x, 0)
    skipping = jax.jit(jax.grad(loss), static_argnums=1)(x, 5)
    # Each token's terms are its own: the same float32 operations, gathered and scattered back.
    np.testing.assert_allclose(np.asarray(skipping), np.asarray(whole), rtol=1e-6, atol=1e-7)
