"""The batcher against a slow per-trajectory reference; exact gradient accumulation; prefetching."""


import jax
import numpy as np
import pytest

from headrace.config import LearnerConfig, LossConfig, ShapesConfig
from headrace.learner.batching import Batch, Batcher
from headrace.learner.train_step import init_state, make_optimizer, make_train_step
from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.model.transformer import ModelDims
from headrace.types import STATUS_ERROR, Group, Trajectory
from tests.adam_check import assert_moments, assert_params_follow_moments

BUCKETS = (8, 16, 32)


def make_groups(lengths_per_group, seed=0, vocab=32):
    """Groups whose trajectories have globally unique first tokens (their index), random rest."""
    rng = np.random.default_rng(seed)
    groups, index = [], 0
    for g, lengths in enumerate(lengths_per_group):
        items = []
        for n in lengths:
            tokens = rng.integers(0, vocab, n).astype(np.int32)
            tokens[0] = 1000 + index
            items.append(Trajectory(
                f"t{index}", f"g{g}", f"task{g}", "e", "a", tokens, rng.random(n) < 0.6,
                -rng.random(n).astype(np.float32),
                rng.integers(0, 5, n).astype(np.int32), [], float(rng.normal())))
            index += 1
        groups.append(Group(f"g{g}", f"task{g}", items))
    return groups


def segments(batch):
    """{first token: (minibatch, per-field arrays)} read back from the packed microbatches."""
    out = {}
    for mb in batch.microbatches:
        seg = mb.arrays["segment_ids"]
        for row in range(seg.shape[0]):
            for s in range(1, seg[row].max() + 1):
                cols = np.flatnonzero(seg[row] == s)
                assert np.all(np.diff(cols) == 1), "a segment must be contiguous"
                fields = {k: np.asarray(v[row, cols]) for k, v in mb.arrays.items()}
                out[int(fields["tokens"][0])] = (mb.minibatch, fields)
    return out


def reference(groups, cfg: LearnerConfig, longest: int):
    """Slow reference: per trajectory the expected per-token fields, minibatch by minibatch."""
    per_mb = np.array_split(np.arange(len(groups)), cfg.minibatches)
    expected = {}
    for m, split in enumerate(per_mb):
        chosen = []
        for gi in split:
            group = groups[gi]
            valid = [t.status != STATUS_ERROR for t in group.trajectories]
            rewards = [t.reward for t, v in zip(group.trajectories, valid) if v]
            mean = sum(rewards) / len(rewards)
            for t, v in zip(group.trajectories, valid):
                n = min(len(t), longest)
                mask = [bool(x) for x in t.loss_mask[:n]]
                mask[0] = False
                if v and any(mask):
                    chosen.append((t, n, mask, t.reward - mean if len(rewards) > 1 else 0.0))
        total = sum(sum(mask) for _, _, mask, _ in chosen)
        for t, n, mask, adv in chosen:
            if cfg.loss_agg == "token_mean":
                weight = [x / total for x in mask]
            elif cfg.loss_agg == "token_sum":
                weight = [x / (len(chosen) * longest) for x in mask]
            else:
                weight = [x / sum(mask) / len(chosen) for x in mask]
            expected[int(t.tokens[0])] = (m, t, n, mask, adv, weight)
    return expected


@pytest.mark.parametrize("loss_agg", ["token_mean", "sequence_mean", "token_sum"])
@pytest.mark.parametrize("budget", [0, 32])
def test_batch_matches_reference(loss_agg, budget):
    rng = np.random.default_rng(1)
    lengths = [list(rng.integers(1, 40, 4)) for _ in range(6)]  # some longer than 32: truncated
    groups = make_groups(lengths)
    groups[2].trajectories[1].status = STATUS_ERROR
    groups[1].trajectories[1].loss_mask[:] = [True] + [False] * (len(groups[1].trajectories[1]) - 1)
    cfg = LearnerConfig(groups_per_batch=6, minibatches=2, token_budget=budget, loss_agg=loss_agg)
    metrics = Metrics()
    batch = Batcher(cfg, ShapesConfig(buckets=BUCKETS), metrics).build(groups)
    got, want = segments(batch), reference(groups, cfg, BUCKETS[-1])
    assert set(got) == set(want)
    for key, (m, t, n, mask, adv, weight) in want.items():
        minibatch, fields = got[key]
        assert minibatch == m
        np.testing.assert_array_equal(fields["tokens"], t.tokens[:n])
        np.testing.assert_array_equal(fields["positions"], np.arange(n))
        np.testing.assert_array_equal(fields["loss_mask"], mask)
        np.testing.assert_allclose(fields["behaviour_logprobs"], t.behaviour_logprobs[:n])
        np.testing.assert_array_equal(fields["policy_version"], t.policy_version[:n])
        np.testing.assert_allclose(fields["advantages"], adv, atol=1e-6)
        np.testing.assert_allclose(fields["weight"], weight, rtol=1e-6)
    for m in range(2):  # weights sum to 1 over each minibatch, across its microbatches...
        total = sum(mb.arrays["weight"].sum() for mb in batch.microbatches if mb.minibatch == m)
        if loss_agg == "token_sum":  # ...but Dr. GRPO's, loss tokens over a constant
            tokens = sum(sum(mask) for mb, _, _, mask, _, _ in want.values() if mb == m)
            trajectories = sum(mb == m for mb, *_ in want.values())
            assert total == pytest.approx(tokens / (trajectories * BUCKETS[-1]), rel=1e-5)
        else:
            assert total == pytest.approx(1.0, abs=1e-5)
    assert [mb.minibatch for mb in batch.microbatches] == sorted(
        mb.minibatch for mb in batch.microbatches)
    assert [mb.last for mb in batch.microbatches].count(True) == batch.updates == 2
    following = [mb.minibatch for mb in batch.microbatches[1:]] + [None]
    assert [mb.last for mb in batch.microbatches] == [
        mb.minibatch != nxt for mb, nxt in zip(batch.microbatches, following)]
    truncated = sum(len(t) > 32 for g in groups for t in g.trajectories if t.status != "error")
    assert metrics.counters["batch/truncated"] == truncated > 0
    assert metrics.gauges["batch/packing_efficiency"] == pytest.approx(batch.packing_efficiency)
    if budget:
        assert batch.shapes <= {(4, 8), (2, 16), (1, 32)}


def test_overlong_reject_is_counted_and_left_out():
    groups = make_groups([[10, 50, 20, 33]])
    metrics = Metrics()
    cfg = LearnerConfig(groups_per_batch=1, token_budget=32)
    batch = Batcher(cfg, ShapesConfig(buckets=BUCKETS, overlong="reject"), metrics).build(groups)
    assert metrics.counters["batch/rejected"] == 2
    assert "batch/truncated" not in metrics.counters
    lengths = sorted(len(f["tokens"]) for _, f in segments(batch).values())
    assert lengths == [10, 20]


def test_nothing_to_train_gives_an_empty_batch():
    groups = make_groups([[5, 6]])
    for t in groups[0].trajectories:
        t.loss_mask[:] = False
    batch = Batcher(LearnerConfig(groups_per_batch=1), ShapesConfig(buckets=BUCKETS),
                    Metrics()).build(groups)
    assert batch.microbatches == [] and batch.updates == 0 and batch.packing_efficiency == 1.0


@pytest.mark.timeout(120)
def test_microbatch_gradients_sum_to_the_minibatch_gradient():
    """Many small microbatches (token budget 32) update exactly like one microbatch (no budget),
    with two minibatches and the decoupled loss (its proximal policy: the step's first weights)."""
    groups = make_groups([[5, 9, 14, 30], [3, 8, 21, 12], [7, 7, 25, 2], [16, 11, 4, 19]])
    dims = ModelDims(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
    graphdef, params = params_lib.init(dims, 0)
    for g in groups:
        for t in g.trajectories:
            t.tokens[0] = t.tokens[0] % 32
    results = []
    for budget in (0, 32):
        cfg = LearnerConfig(groups_per_batch=4, minibatches=2, token_budget=budget,
                            loss=LossConfig(kind="decoupled"), entropy_coef=0.01)
        batch = Batcher(cfg, ShapesConfig(buckets=(16, 32)), Metrics()).build(groups)
        optimizer = make_optimizer(cfg.optimizer)
        step = make_train_step(graphdef, cfg, 1.0, optimizer)
        first = Batch([mb for mb in batch.microbatches if mb.minibatch == 0], 1, 0, 0, 0, 0)
        half, _ = step(init_state(jax.tree.map(np.array, params), optimizer, 0.0), first)
        half = jax.device_get(half)
        state = init_state(jax.tree.map(np.array, params), optimizer, 0.0)
        state, metrics = step(state, batch)
        results.append((len(batch.microbatches), half, jax.device_get((state, metrics))))
    (n_single, half_single, (single, m_single)), (n_micro, half_micro, (micro, m_micro)) = results
    assert n_single == 2 and n_micro > 4
    assert int(single.step) == int(micro.step) == 2
    # The same update, by the error analysis of tests/adam_check.py: each update's gradient (the
    # moments), and each run's parameters from its own moments (no per-entry tolerance between
    # the two runs' parameters: Adam turns a small gradient's rounding into a visible step).
    assert_moments(half_micro, half_single, 1e-5)
    assert_moments(micro, single, 1e-4)
    initial = params_lib.flatten(jax.device_get(params))
    for half, state in ((half_single, single), (half_micro, micro)):
        assert_params_follow_moments(initial, (half, state), cfg.optimizer.lr, cfg.optimizer.b1,
                                     cfg.optimizer.b2)
    for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(micro.params)):
        assert np.abs(a - b).max() <= 2 * cfg.optimizer.lr  # within lr per update
    for key in ("loss/pg", "loss/entropy", "learner/grad_norm", "is/ess", "is/ratio_max"):
        assert m_single[key] == pytest.approx(m_micro[key], rel=1e-4, abs=1e-6), key


@pytest.mark.timeout(120)
def test_epochs_are_passes_over_the_same_batch():
    """`learner.epochs = 2` updates exactly like two steps on the same batch (ppo_clip: the old
    policy is the behaviour's, so each pass's loss depends only on the current weights); its
    metrics average over all four updates."""
    groups = make_groups([[5, 9, 14, 30], [3, 8, 21, 12]])
    dims = ModelDims(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
    graphdef, params = params_lib.init(dims, 0)
    for g in groups:
        for t in g.trajectories:
            t.tokens[0] = t.tokens[0] % 32
    runs = {}
    for epochs, steps in ((2, 1), (1, 2)):
        cfg = LearnerConfig(groups_per_batch=2, minibatches=2, epochs=epochs,
                            loss=LossConfig(kind="ppo_clip"), entropy_coef=0.01)
        batch = Batcher(cfg, ShapesConfig(buckets=(16, 32)), Metrics()).build(groups)
        optimizer = make_optimizer(cfg.optimizer)
        state = init_state(jax.tree.map(np.array, params), optimizer, 0.0)
        step, grad_norms = make_train_step(graphdef, cfg, 1.0, optimizer), []
        for _ in range(steps):
            state, metrics = step(state, batch)
            grad_norms.append(float(metrics["learner/grad_norm"]))
        runs[epochs] = jax.device_get(state), float(metrics["learner/grad_norm"]), grad_norms
    (two_epochs, norm_two, _), (two_steps, _, norms) = runs[2], runs[1]
    assert int(two_epochs.step) == int(two_steps.step) == 4
    for a, b in zip(jax.tree.leaves(two_epochs.params), jax.tree.leaves(two_steps.params)):
        np.testing.assert_allclose(a, b, atol=2e-6)
    assert norm_two == pytest.approx(sum(norms) / 2, rel=1e-4)  # the mean over four updates


# --- prefetching ---------------------------------------------------------------------------------


def _batcher():
    return Batcher(LearnerConfig(groups_per_batch=1, token_budget=32),
                   ShapesConfig(buckets=BUCKETS), Metrics())
