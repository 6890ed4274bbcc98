"""Top log-probs: each generated token's k likeliest alternatives, against a float64 reference of
the distribution it was drawn from (temperature applied, untruncated); a separate program, so
`generate` compiles and computes nothing for them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from headrace.model import params as params_lib
from headrace.model.sampler import TOP_LOGPROBS, Sampler, SamplerSettings
from headrace.model.transformer import ModelDims, segment_mask

DIMS = ModelDims(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
# Tolerance: the reference takes the float32 model's logits of a full forward pass and does the
# rest in float64. The sampler's log-probs differ by (a) its KV-cache decode against the full
# forward (attention summed in another order: ~1e-6 on logits of magnitude < 10 at d 32, as
# `test_sampler.py` measures) and (b) the float32 log-softmax (a few eps32 x (|x| + log V),
# < 1e-5). 1e-5 holds both with margin; a wrong temperature or a truncated distribution is off by
# far more than that (tested below).
ATOL = 1e-5


REF_LEN = 32  # the reference runs at one padded length (one compile): causal, so padding after
# the tokens changes none of their logits


@jax.jit
def _logits(graphdef, params, tokens_t):
    model = params_lib.merge(graphdef, params)
    tokens = tokens_t[None]
    logits, _ = model(tokens, jnp.arange(REF_LEN)[None], segment_mask(jnp.ones_like(tokens)))
    return logits[0]


def reference_logp(graphdef, params, context, generated, temperature):
    """float64 log-probs [len(generated), V] of the distribution at each generated position."""
    tokens = np.zeros(REF_LEN, np.int32)
    tokens[:len(context) + len(generated)] = np.concatenate([context, generated])
    logits = np.asarray(jax.device_get(_logits(graphdef, params, tokens)), np.float64)
    scaled = logits[len(context) - 1:len(context) + len(generated) - 1] / temperature
    return scaled - np.logaddexp.reduce(scaled, axis=-1, keepdims=True)


def check_tops(ref_gv, logps, ids_gk, lps_gk, k):
    assert ids_gk.shape == lps_gk.shape == (len(logps), k)
    assert ids_gk.dtype == np.int32 and lps_gk.dtype == np.float32
    expected_gk = -np.sort(-ref_gv, axis=-1)[:, :k]  # the k largest, in order (tie-proof)
    np.testing.assert_allclose(lps_gk, expected_gk, rtol=0, atol=ATOL)
    np.testing.assert_allclose(np.take_along_axis(ref_gv, ids_gk, -1), lps_gk, rtol=0, atol=ATOL)
    assert all(len(set(row)) == k for row in ids_gk.tolist())  # k distinct tokens


@pytest.mark.parametrize("max_new, top_p, episodes", [(5, 1.0, 0), (1, 1.0, 0), (4, 0.7, 2)])
def test_top_logprobs_match_a_float64_reference(max_new, top_p, episodes):
    graphdef, params = params_lib.init(DIMS, seed=3)
    settings = SamplerSettings(temperature=0.7, top_p=top_p, max_new_tokens=max_new,
                               stop_ids=(2,))
    sampler = Sampler(graphdef, settings, DIMS.vocab_size, buckets=(32,), max_batch=8,
                      seed=0, episodes=episodes)
    sampler.set_params(params, version=2)
    rng = np.random.default_rng(0)
    contexts = [rng.integers(3, 40, n).astype(np.int32) for n in (2, 5)]  # 3 turns in one bucket
    slots = list(range(episodes)) or None
    for k in (1, 5, TOP_LOGPROBS):
        tokens, logps, tops, version = sampler.generate_top(contexts, k, slots=slots)
        assert version == 2 and len(tops) == len(contexts)
        for context, t, lp, (ids_gk, lps_gk) in zip(contexts, tokens, logps, tops):
            ref_gv = reference_logp(graphdef, params, context, t, 0.7)
            check_tops(ref_gv, lp, ids_gk, lps_gk, k)
            # the token's own log-prob is of the same distribution as its alternatives
            np.testing.assert_allclose(lp, ref_gv[np.arange(len(t)), t], rtol=0, atol=ATOL)
        if slots:  # next turn: the kept caches continue, alternatives still exact
            contexts = [np.concatenate([c, t, [7, 8]]).astype(np.int32)
                        for c, t in zip(contexts, tokens)]
    # the reference can tell: at temperature 1 the alternatives differ by far more than ATOL
    wrong_gv = reference_logp(graphdef, params, contexts[0], tokens[0], 1.0)
    assert np.abs(-np.sort(-wrong_gv, axis=-1)[:, :k] - tops[0][1]).max() > 100 * ATOL


def test_generate_pays_nothing_and_draws_the_same_tokens():
    """`generate` runs no top program; with one seed both variants draw the same tokens."""
    graphdef, params = params_lib.init(DIMS, seed=5)
    settings = SamplerSettings(temperature=1.0, max_new_tokens=4)
    plain = Sampler(graphdef, settings, DIMS.vocab_size, buckets=(16,), max_batch=8, seed=7)
    topped = Sampler(graphdef, settings, DIMS.vocab_size, buckets=(16,), max_batch=8, seed=7)
    for s in (plain, topped):
        s.set_params(params, 0)
    contexts = [np.arange(3, 9, dtype=np.int32), np.arange(10, 13, dtype=np.int32)]
    tokens, logps, _ = plain.generate(contexts)
    assert {key.top for key in plain.programs.compiled} == {0}
    top_tokens, top_logps, _, _ = topped.generate_top(contexts, 3)
    assert {key.top for key in topped.programs.compiled} == {TOP_LOGPROBS}
    for a, b, la, lb in zip(tokens, top_tokens, logps, top_logps):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(la, lb, rtol=0, atol=ATOL)
    with pytest.raises(ValueError, match="1 to 20"):
        topped.generate_top(contexts, TOP_LOGPROBS + 1)
