"""Segment-aware attention: trajectories packed in one row score exactly as they do alone."""

import functools

import jax
import numpy as np

from headrace.config import LearnerConfig, ShapesConfig
from headrace.learner.batching import Batcher
from headrace.learner.train_step import _logprobs
from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.model.transformer import ModelDims, segment_mask
from headrace.types import Group, Trajectory

VOCAB = 64


def _trajectory(i: int, n: int, rng) -> Trajectory:
    tokens = rng.integers(1, VOCAB, n).astype(np.int32)
    tokens[0] = i  # the first token names the trajectory (ids 0..VOCAB-1 are all valid)
    return Trajectory(f"t{i}", "g", "task", "e", "a", tokens, np.ones(n, bool),
                      np.zeros(n, np.float32), np.zeros(n, np.int32), [], float(i % 2))


def test_segment_mask_is_causal_within_segments_and_blind_to_padding():
    seg = np.array([[1, 1, 2, 2, 2, 0]])
    mask = np.asarray(segment_mask(seg))[0]
    expected = np.zeros((6, 6), bool)
    expected[0, 0] = expected[1, :2] = True
    expected[2, 2] = expected[3, 2:4] = expected[4, 2:5] = True
    np.testing.assert_array_equal(mask, expected)


def test_packed_logprobs_equal_solo_logprobs():
    rng = np.random.default_rng(0)
    lengths = [5, 9, 3, 12, 7, 16, 2, 11, 6, 4, 13, 8]
    trajectories = [_trajectory(i, n, rng) for i, n in enumerate(lengths)]
    batcher = Batcher(LearnerConfig(groups_per_batch=1, token_budget=64),
                      ShapesConfig(buckets=(8, 16, 32)), Metrics())
    batch = batcher.build([Group("g", "task", trajectories)])
    assert batch.trajectories == len(lengths)
    dims = ModelDims(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    graphdef, params = params_lib.init(dims, 3)
    logprobs = jax.jit(functools.partial(_logprobs, graphdef, temperature=1.0, allowed_v=None))

    packed_rows = 0
    seen = set()
    for mb in batch.microbatches:
        packed = np.asarray(logprobs(params, mb.arrays)[0])  # [R, W-1]: j scores token j+1
        segments = mb.arrays["segment_ids"]
        packed_rows += int((segments.max(axis=1) >= 2).sum())
        for row in range(segments.shape[0]):
            for s in range(1, segments[row].max() + 1):
                cols = np.flatnonzero(segments[row] == s)
                start, n = cols[0], len(cols)
                trajectory = trajectories[mb.arrays["tokens"][row, start]]
                assert n == len(trajectory)
                np.testing.assert_array_equal(mb.arrays["positions"][row, cols], np.arange(n))
                # Alone in a row (trailing padding is causally invisible; one compiled shape).
                alone = {"tokens": np.zeros((1, 32), np.int32),
                         "positions": np.zeros((1, 32), np.int32),
                         "segment_ids": np.zeros((1, 32), np.int32)}
                alone["tokens"][0, :n] = trajectory.tokens
                alone["positions"][0, :n] = np.arange(n)
                alone["segment_ids"][0, :n] = 1
                solo = np.asarray(logprobs(params, alone)[0])[0, :n - 1]
                np.testing.assert_allclose(packed[row, start:start + n - 1], solo, atol=1e-5)
                seen.add(trajectory.trajectory_id)
    assert len(seen) == len(lengths)
    assert packed_rows >= 2, "the test should pack several trajectories into some rows"


def test_last_only_logits_are_the_last_row_of_the_full_forward():
    """`last_only` (the sampler's prefill) gives the full forward's last-position logits, and the
    same cache, with or without one."""
    dims = ModelDims(vocab_size=VOCAB, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64)
    graphdef, params = params_lib.init(dims, 0)
    model = params_lib.merge(graphdef, params)
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, VOCAB, (3, 7)).astype(np.int32)
    valid = np.ones((3, 7), bool)
    valid[0, :3] = valid[2, :1] = False  # left padding, as the sampler lays contexts out
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
    mask = valid[:, None, :] & np.tril(np.ones((7, 7), bool))[None]
    full, _ = model(tokens, positions, mask)
    last, _ = model(tokens, positions, mask, last_only=True)
    assert last.shape == (3, 1, VOCAB)
    np.testing.assert_allclose(last[:, 0], full[:, -1], rtol=1e-5, atol=1e-5)
    slots_mask = np.concatenate([mask, np.zeros((3, 7, 2), bool)], axis=2)  # 9 cache slots
    write = np.broadcast_to(np.arange(7), (3, 7))  # the cache slot of each token
    _, cache_full = model(tokens, positions, slots_mask, model.init_cache(3, 9), write)
    _, cache_last = model(tokens, positions, slots_mask, model.init_cache(3, 9), write,
                          last_only=True)
    for a, b in zip(jax.tree.leaves(cache_full), jax.tree.leaves(cache_last)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_tiled_attention_matches_one_score_matrix(monkeypatch):
    """A row longer than `QUERY_CHUNK` is attended in query tiles (the last one ragged); its
    log-probs and gradients are those of one [t, t] score matrix."""
    from headrace.model import transformer

    rng = np.random.default_rng(2)
    width = 2 * transformer.QUERY_CHUNK + 88
    segment_ids = np.zeros((2, width), np.int32)
    segment_ids[0, :300], segment_ids[0, 300:550] = 1, 2  # two segments, padding after
    segment_ids[1, :width] = 1
    positions = np.zeros_like(segment_ids)
    for row in range(2):
        for s in (1, 2):
            cols = np.flatnonzero(segment_ids[row] == s)
            positions[row, cols] = np.arange(len(cols))
    mb = {"tokens": rng.integers(0, VOCAB, (2, width)).astype(np.int32),
          "positions": positions, "segment_ids": segment_ids}
    dims = ModelDims(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    graphdef, params = params_lib.init(dims, 5)
    real = segment_ids[:, 1:] != 0  # scored tokens inside a segment

    def run():
        def loss(p):
            logp, _ = _logprobs(graphdef, p, mb, temperature=1.0, allowed_v=None)
            return -(logp * real).sum(), logp
        (_, logp), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return np.asarray(logp), grads

    tiled_logp, tiled_grads = run()
    monkeypatch.setattr(transformer, "QUERY_CHUNK", 10 * width)
    whole_logp, whole_grads = run()
    np.testing.assert_allclose(tiled_logp[real], whole_logp[real], atol=1e-5)
    for a, b in zip(jax.tree.leaves(tiled_grads), jax.tree.leaves(whole_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
