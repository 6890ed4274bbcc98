"""The sampler's log-probs are the learner's: equal to a full forward pass at the same temperature."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from headrace.metrics import compiles
from headrace.model import params as params_lib
from headrace.model.sampler import PromptTooLong, Sampler, SamplerSettings
from headrace.model.transformer import ModelDims, segment_mask
from headrace.shapes import batch_ladder, split_rows

DIMS = ModelDims(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)


def full_forward_logprobs(graphdef, params, context, generated, temperature, allowed=None):
    """Reference: one forward pass over context + generated, the policy distribution per token."""
    model = params_lib.merge(graphdef, params)
    tokens = jnp.asarray(np.concatenate([context, generated]))[None]
    positions = jnp.arange(tokens.shape[1])[None]
    logits, _ = model(tokens, positions, segment_mask(jnp.ones_like(tokens)))
    scaled = logits[0] / temperature
    if allowed is not None:  # constrained decoding: the policy is restricted to the actions
        keep = np.zeros(DIMS.vocab_size, bool)
        keep[list(allowed)] = True
        scaled = jnp.where(keep, scaled, -jnp.inf)
    logp = jax.nn.log_softmax(scaled, axis=-1)
    return np.array([logp[len(context) - 1 + i, t] for i, t in enumerate(generated)])


@pytest.mark.parametrize("max_new, top_k, top_p, allowed", [
    (6, 0, 1.0, None), (1, 0, 1.0, None), (4, 5, 0.8, tuple(range(10, 30)))])
def test_logprobs_match_full_forward(max_new, top_k, top_p, allowed):
    graphdef, params = params_lib.init(DIMS, seed=3)
    settings = SamplerSettings(temperature=0.7, top_k=top_k, top_p=top_p, max_new_tokens=max_new,
                               stop_ids=(2,), allowed_ids=allowed)
    sampler = Sampler(graphdef, settings, DIMS.vocab_size, buckets=(16, 32), max_batch=8, seed=0)
    sampler.set_params(params, version=5)
    rng = np.random.default_rng(0)
    contexts = [rng.integers(3, 40, n).astype(np.int32) for n in (1, 4, 9, 17)]
    tokens, logps, version = sampler.generate(contexts)
    assert version == 5
    for context, t, lp in zip(contexts, tokens, logps):
        assert 1 <= len(t) <= max_new
        if allowed is not None:  # one action word per turn
            assert len(t) == 1 and int(t[0]) in allowed
        assert (t[:-1] != 2).all(), "generation continues past a stop token"
        ref = full_forward_logprobs(graphdef, params, context, t, 0.7, allowed)
        np.testing.assert_allclose(lp, ref, atol=1e-5)


def test_greedy_is_argmax_and_deterministic():
    graphdef, params = params_lib.init(DIMS, seed=1)
    settings = SamplerSettings(temperature=1.0, max_new_tokens=1)
    sampler = Sampler(graphdef, settings, DIMS.vocab_size, buckets=(8,), max_batch=8)
    sampler.set_params(params, 0)
    context = np.array([1, 5, 7], np.int32)
    a, _, _ = sampler.generate([context], greedy=True)
    b, _, _ = sampler.generate([context], greedy=True)
    model = params_lib.merge(graphdef, params)
    tokens = jnp.asarray(context)[None]
    logits, _ = model(tokens, jnp.arange(3)[None], segment_mask(jnp.ones_like(tokens)))
    assert a[0][0] == b[0][0] == int(jnp.argmax(logits[0, -1]))


def test_too_long_context_is_refused():
    graphdef, params = params_lib.init(DIMS, seed=1)
    sampler = Sampler(graphdef, SamplerSettings(max_new_tokens=4), DIMS.vocab_size, (8, 16), 8)
    sampler.set_params(params, 0)
    with pytest.raises(PromptTooLong, match="does not fit the largest bucket 16"):
        sampler.generate([np.ones(13, np.int32)])


def test_no_recompilation_across_prompt_lengths():
    compiles.install()
    graphdef, params = params_lib.init(DIMS, seed=2)
    sampler = Sampler(graphdef, SamplerSettings(max_new_tokens=2), DIMS.vocab_size,
                      buckets=(8, 16, 32), max_batch=32)
    sampler.set_params(params, 0)
    rng = np.random.default_rng(1)
    before = compiles.compiles("generate")
    for n in range(1, 31):
        rows = int(rng.integers(1, 33))
        sampler.generate([rng.integers(3, 40, n).astype(np.int32) for _ in range(rows)])
    # At most |batch ladder| x |buckets| programs, however many lengths and row counts arrive.
    assert compiles.compiles("generate") - before <= len(sampler.batch_sizes) * 3


def test_rows_split_over_several_calls_keep_their_order_and_logprobs():
    graphdef, params = params_lib.init(DIMS, seed=4)
    sampler = Sampler(graphdef, SamplerSettings(temperature=0.9, max_new_tokens=3),
                      DIMS.vocab_size, buckets=(16,), max_batch=256, seed=0)
    sampler.set_params(params, 0)
    assert split_rows(75, sampler.batch_sizes) == [64, 16]  # two calls, 80 rows (not 256)
    rng = np.random.default_rng(2)
    contexts = [rng.integers(3, 40, int(rng.integers(1, 13))).astype(np.int32)
                for _ in range(75)]
    tokens, logps, _ = sampler.generate(contexts)
    assert len(tokens) == len(logps) == 75
    for i in (0, 40, 63, 64, 74):  # both calls, at their edges
        ref = full_forward_logprobs(graphdef, params, contexts[i], tokens[i], 0.9)
        np.testing.assert_allclose(logps[i], ref, atol=1e-5)


def test_split_rows_pads_little_with_ladder_sizes_only():
    sizes = batch_ladder(1024)
    assert split_rows(300, sizes) == [256, 64]  # not one call of 1024
    assert split_rows(1024, sizes) == [1024] and split_rows(3, sizes) == [8]
    for count in range(1, 1025):
        calls = split_rows(count, sizes)
        assert set(calls) <= set(sizes) and len(calls) <= 4
        assert count <= sum(calls) <= 2 * max(count * 1.25, count + 8), (count, calls)
    assert split_rows(389, batch_ladder(512)) == [512]  # 4 calls would save only a quarter
    with pytest.raises(ValueError, match="exceed the largest batch size 1024"):
        split_rows(1025, sizes)


@pytest.mark.parametrize("max_new, background", [(1, False), (3, False), (3, True)])
def test_kept_caches_match_full_forward_over_turns(max_new, background):
    """Turns computed from each episode's kept cache give the full forward's log-probs (also
    when they ride in other shapes' programs while their own compile)."""
    graphdef, params = params_lib.init(DIMS, seed=4)
    settings = SamplerSettings(temperature=0.8, max_new_tokens=max_new, stop_ids=(2,))
    sampler = Sampler(graphdef, settings, DIMS.vocab_size, buckets=(8, 16, 32), max_batch=8,
                      seed=1, episodes=4, background_compiles=background)
    sampler.set_params(params, 0)
    rng = np.random.default_rng(0)
    contexts = {slot: rng.integers(3, 40, n).astype(np.int32)
                for slot, n in zip((0, 2, 3), (2, 5, 9))}
    for turn in range(3):
        slots = list(contexts)
        kept = [sampler.kept.prefix(k, contexts[k]) for k in slots]
        assert (min(kept) > 0) == (turn > 0)  # later turns start from what the slot holds
        tokens, logps, _ = sampler.generate([contexts[k] for k in slots], slots=slots)
        for k, t, lp in zip(slots, tokens, logps):
            ref = full_forward_logprobs(graphdef, params, contexts[k], t, 0.8)
            np.testing.assert_allclose(lp, ref, atol=1e-5)
            observation = rng.integers(3, 40, 2).astype(np.int32)
            contexts[k] = np.concatenate([contexts[k], t, observation])
    # Another episode in slot 0: nothing it holds matches, so the context is computed afresh.
    other = np.concatenate([[contexts[0][0] % 37 + 1], rng.integers(3, 40, 5)]).astype(np.int32)
    assert sampler.kept.prefix(0, other) == 0
    tokens, logps, _ = sampler.generate([other], slots=[0])
    np.testing.assert_allclose(logps[0], full_forward_logprobs(graphdef, params, other,
                                                               tokens[0], 0.8), atol=1e-5)


def _wait_for_compiler(sampler: Sampler, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sampler.programs.compiling:
        assert time.monotonic() < deadline, "background compiles did not finish"
        time.sleep(0.05)


def test_new_shapes_compile_in_the_background_while_compiled_programs_serve():
    """An actor's sampler waits for a compile only when no compiled program can hold a call's
    rows; otherwise they ride in a wider or smaller program, with the same log-probs."""
    graphdef, params = params_lib.init(DIMS, seed=5)
    sampler = Sampler(graphdef, SamplerSettings(temperature=0.8, max_new_tokens=2),
                      DIMS.vocab_size, buckets=(8, 16), max_batch=64, background_compiles=True)
    sampler.set_params(params, 0)
    rng = np.random.default_rng(3)
    try:
        def check(lengths):
            contexts = [rng.integers(3, 40, n).astype(np.int32) for n in lengths]
            tokens, logps, _ = sampler.generate(contexts)
            for context, t, lp in zip(contexts, tokens, logps):
                ref = full_forward_logprobs(graphdef, params, context, t, 0.8)
                np.testing.assert_allclose(lp, ref, atol=1e-5)

        check([10, 12, 9])  # nothing compiled: 8 rows of width 14 compile in line
        assert sampler.inline_compiles == 1
        assert split_rows(40, sampler.batch_sizes) == [64]
        check([3] * 40)  # width 6, 64 rows: served by five calls of the 8 x 14 program
        assert sampler.inline_compiles == 1
        _wait_for_compiler(sampler)
        assert {(8, 14), (64, 6)} <= {(k[2], k[3]) for k in sampler.programs.compiled}
        assert sampler.compiles == 2
        check([5] * 40)  # its own program now
        assert sampler.inline_compiles == 1 and len(sampler.programs.compiled) == 2
    finally:
        sampler.close()


@pytest.mark.parametrize("episodes", [0, 4])
def test_a_precompiled_sampler_compiles_nothing_more(episodes):
    """After `precompile`, calls of every length and row count (with kept caches: turns that
    continue and contexts computed afresh) run compiled programs: the compile count stays."""
    graphdef, params = params_lib.init(DIMS, seed=6)
    sampler = Sampler(graphdef, SamplerSettings(temperature=0.8, max_new_tokens=2, stop_ids=(2,)),
                      DIMS.vocab_size, buckets=(8, 16), max_batch=16, episodes=episodes)
    sampler.set_params(params, 0)
    assert sampler.batch_sizes == (8, 16)
    # Per row count: without kept caches a width per bucket; with them, bucket 8's continuing
    # width is its whole width, so three.
    assert sampler.precompile() == (3 if episodes else 2) * 2
    compiled = sampler.compiles
    rng = np.random.default_rng(1)
    if not episodes:
        for rows in (1, 3, 9, 16):
            contexts = [rng.integers(3, 40, rng.integers(1, 15)).astype(np.int32)
                        for _ in range(rows)]
            sampler.generate(contexts)
    else:  # an actor's calls all have slots (a slot per environment)
        contexts = {k: rng.integers(3, 40, 3 if k % 2 else 9).astype(np.int32)  # 9: afresh
                    for k in range(episodes)}
        for _ in range(2):  # turns continue from the kept caches
            tokens, _, _ = sampler.generate(list(contexts.values()), slots=list(contexts))
            contexts = {k: np.concatenate([c, t, [5]]) for (k, c), t in zip(contexts.items(),
                                                                              tokens)}
    assert sampler.compiles == compiled and sampler.inline_compiles == 0
    assert sampler.precompile() == 0


def _fresh_episode_logps(release: bool):
    """Two episodes in turn in slot 0 with one prompt (a fixed task prompt), the weights updated
    between them: the second's tokens and log-probs, and the new weights."""
    graphdef, old = params_lib.init(DIMS, seed=3)
    _, new = params_lib.init(DIMS, seed=4)
    sampler = Sampler(graphdef, SamplerSettings(temperature=1.0, max_new_tokens=1),
                      DIMS.vocab_size, buckets=(16,), max_batch=8, seed=0, episodes=1)
    prompt = np.arange(3, 12, dtype=np.int32)
    sampler.set_params(old, 0)
    sampler.generate([prompt], slots=[0])
    if release:
        sampler.release(0)
    sampler.set_params(new, 1)
    tokens, logps, version = sampler.generate([prompt], slots=[0])
    assert version == 1
    return graphdef, new, prompt, tokens[0], logps[0]


def test_a_released_slot_is_computed_afresh_by_the_next_episode():
    """The next episode in a released slot gets the new weights' log-probs, not ones computed on
    the keys and values the last episode's (older) weights left there."""
    graphdef, new, prompt, tokens, logps = _fresh_episode_logps(release=True)
    np.testing.assert_allclose(logps, full_forward_logprobs(graphdef, new, prompt, tokens, 1.0),
                               atol=1e-5)
    # the check can tell: reusing the slot unreleased mixes the two weights by far more
    graphdef, new, prompt, tokens, logps = _fresh_episode_logps(release=False)
    ref = full_forward_logprobs(graphdef, new, prompt, tokens, 1.0)
    assert np.abs(logps - ref).max() > 100 * 1e-5
