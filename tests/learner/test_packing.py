"""Packing plans against a brute-force occupancy grid, the shape policy, and the packing bench."""

import itertools
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from headrace.config import ConfigError, LearnerConfig, ShapesConfig, load
from headrace.learner import packing
from headrace.learner.batching import Batcher
from headrace.metrics.core import Metrics
from headrace.shapes import ShapePolicy, TooLong, bucket_for, choose_ladder, rows_for_count
from tests.learner.test_batching import make_groups, reference, segments

LADDER = tuple(2**i for i in range(5, 13))
ROOT = pathlib.Path(__file__).resolve().parents[2]
TRACE = ROOT / "headrace/benchmarks/data/smollm2_lengths.txt"


def lognormal(n, seed=0, median=500, sigma=1.0, lo=16, hi=4096):
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), lo, hi)]


def check_plan(lengths, plans):
    """Every trajectory exactly once, inside its row, no two overlapping (a grid of cells)."""
    seen = []
    for plan in plans:
        grid = np.zeros(plan.shape, int)
        for p in plan.placements:
            assert 0 <= p.row < plan.rows and p.offset >= 0
            assert p.offset + p.length <= plan.width, "placement crosses the row's end"
            assert p.length == lengths[p.item]
            grid[p.row, p.offset:p.offset + p.length] += 1
            seen.append(p.item)
        assert grid.max() <= 1, "two placements overlap"
        assert grid.sum() == plan.used
    assert sorted(seen) == list(range(len(lengths)))


def test_shape_policy():
    policy = ShapePolicy(LADDER, token_budget=4096)
    assert policy.shapes() == tuple((4096 // b, b) for b in LADDER)
    assert ShapePolicy(LADDER, token_budget=1000).rows(4096) == 1  # at least one row
    assert ShapePolicy(LADDER, token_budget=4096, rows_per_bucket=3).rows(32) == 3
    assert policy.bucket_for(33) == 64 and bucket_for(32, LADDER) == 32
    with pytest.raises(TooLong):
        policy.bucket_for(4097)
    with pytest.raises(ValueError, match="no fixed rows"):
        ShapePolicy(LADDER).shapes()
    with pytest.raises(ValueError, match="not a bucket"):
        policy.rows(100)
    with pytest.raises(ValueError, match="strictly increasing"):
        ShapePolicy((64, 32))
    assert [rows_for_count(n) for n in (0, 1, 3, 8, 9, 11, 17, 120, 129, 192)] == [
        1, 1, 3, 8, 10, 12, 20, 128, 160, 192]
    for n in range(1, 3000):  # the smallest ladder value >= n, never 25 % more than needed
        r = rows_for_count(n)
        assert n <= r <= max(n * 1.25, 8) and rows_for_count(r) == r


def pareto(n, seed=0, median=131, alpha=1.2, lo=16, hi=4096):
    """The bench's `--dist pareto`: lo + a Lomax of shape alpha with the given median."""
    rng = np.random.default_rng(seed)
    scale = (median - lo) / (2 ** (1 / alpha) - 1)
    return [int(x) for x in np.clip(np.round(lo + scale * rng.pareto(alpha, n)), lo, hi)]


def trace(hi=4096):
    """The committed SmolLM2 episode lengths, truncated to `hi` as the batcher does."""
    lines = TRACE.read_text().splitlines()
    return [min(int(x), hi) for x in lines if x and not x.startswith("#")]


def step_efficiency(lengths, policy, per_step=128):
    """Packing efficiency and distinct shapes over steps of `per_step` trajectories."""
    plans = [packing.bucketed(lengths[i:i + per_step], policy)
             for i in range(0, len(lengths), per_step)]
    for step, lengths_step in zip(plans, (lengths[i:i + per_step]
                                          for i in range(0, len(lengths), per_step))):
        check_plan(lengths_step, step)
    used = sum(p.used for step in plans for p in step)
    slots = sum(p.slots for step in plans for p in step)
    return used / slots, {p.shape for step in plans for p in step}


@pytest.mark.parametrize("layout", list(packing.LAYOUTS))
@pytest.mark.parametrize("budget,tail", [(0, 0), (512, 0), (4096, 0), (512, 3), (4096, 2)])
def test_plans_cover_every_trajectory_once_without_overlap(layout, budget, tail):
    policy = ShapePolicy(LADDER, token_budget=budget, tail_splits=tail)
    for seed in range(3):
        lengths = lognormal(97, seed, median=300)
        plans = packing.LAYOUTS[layout](lengths, policy)
        check_plan(lengths, plans)
        if layout == "bucketed" and budget:
            assert {p.shape for p in plans} <= set(policy.shapes())
    assert packing.LAYOUTS[layout]([], policy) == []


def test_bucketed_fills_rows_with_shorter_trajectories():
    policy = ShapePolicy((8, 16, 32), token_budget=32)  # shapes (4, 8), (2, 16), (1, 32)
    plans = packing.bucketed([20, 10, 12, 3, 2, 5], policy)
    check_plan([20, 10, 12, 3, 2, 5], plans)
    # 20 opens a (1, 32) microbatch and 12 fills its rest; 10 opens a (2, 16) one, 5 goes next
    # to 10 (best fit: tighter than the empty row), 3 and 2 share the second row.
    assert [p.shape for p in plans] == [(1, 32), (2, 16)]
    first = {(p.item, p.offset) for p in plans[0].placements}
    assert first == {(0, 0), (2, 20)}
    assert packing.efficiency(plans) == pytest.approx(52 / 64)


def test_bucketed_is_deterministic_and_efficient_on_lognormal_lengths():
    """The benchmark's setting: 4,096 lognormal lengths, 128 per step, budget 4096 -> >= 0.95."""
    policy = ShapePolicy(LADDER, token_budget=4096)
    lengths = lognormal(4096)
    plans = [packing.bucketed(lengths[i:i + 128], policy) for i in range(0, 4096, 128)]
    used = sum(p.used for step in plans for p in step)
    slots = sum(p.slots for step in plans for p in step)
    assert used == sum(lengths)
    assert used / slots >= 0.95
    assert packing.bucketed(lengths[:128], policy) == plans[0]
    padded = sum(p.slots for p in packing.pad_to_max(lengths, policy))
    assert used / padded < 0.25


def test_tail_shapes_halve_a_bucket_rows():
    policy = ShapePolicy((8, 16, 32), token_budget=32, tail_splits=2)
    assert policy.tail_rows(8) == (1, 2, 4) and policy.tail_rows(32) == (1,)
    assert policy.shapes() == ((1, 8), (2, 8), (4, 8), (1, 16), (2, 16), (1, 32))
    assert [policy.rows_holding(8, u) for u in (1, 2, 3, 4)] == [1, 2, 4, 4]
    multiple = ShapePolicy((8, 16), token_budget=64, tail_splits=3, row_multiple=2)
    assert multiple.tail_rows(8) == (2, 4, 8) and multiple.tail_rows(16) == (2, 4)
    assert ShapePolicy((8, 16), token_budget=32).shapes() == ((4, 8), (2, 16))  # no tail: as before
    with pytest.raises(ValueError, match="tail_splits=-1"):
        ShapePolicy((8,), token_budget=8, tail_splits=-1)


def test_a_partly_filled_microbatch_takes_a_tail_shape():
    # 20 opens (1, 32) and 12 fills it; 10 opens (2, 16); 5 and then 1 fill the rest of its first
    # row: one of two rows used, so with a tail the microbatch is (1, 16), placements unchanged.
    lengths = [20, 12, 10, 5, 1]
    full = packing.bucketed(lengths, ShapePolicy((8, 16, 32), token_budget=32))
    tail = packing.bucketed(lengths, ShapePolicy((8, 16, 32), token_budget=32, tail_splits=1))
    check_plan(lengths, tail)
    assert [p.shape for p in full] == [(1, 32), (2, 16)]
    assert [p.shape for p in tail] == [(1, 32), (1, 16)]
    assert [p.placements for p in tail] == [p.placements for p in full]
    assert packing.efficiency(full) == pytest.approx(48 / 64)
    assert packing.efficiency(tail) == 1.0


def test_heavy_tails_pack_above_095_within_eight_shapes():
    """128 trajectories per step, budget 4096: the default ladder leaves most of a step's last
    microbatch empty on short heavy-tailed steps; a ladder chosen from the lengths plus tail
    shapes packs >= 0.95 with at most 8 shapes (the lengths are fixed: a deterministic check)."""
    for name, lengths in (("pareto", pareto(4096)), ("smollm2", trace())):
        before, _ = step_efficiency(lengths, ShapePolicy(LADDER, token_budget=4096))
        ladder = choose_ladder(lengths, 3)
        policy = ShapePolicy(ladder, token_budget=4096, tail_splits=2)
        after, shapes = step_efficiency(lengths, policy)
        assert len(policy.shapes()) <= 8 and shapes <= set(policy.shapes()), name
        assert after >= 0.95 and after > before + 0.005, (name, before, after)
    lengths = lognormal(4096)  # the lognormal bench keeps its packing
    policy = ShapePolicy(choose_ladder(lengths, 3), token_budget=4096, tail_splits=2)
    assert step_efficiency(lengths, policy)[0] >= 0.97


def _ladder_cost(lengths, ladder):
    return sum(n * next(b for b in ladder if b >= n) for n in lengths)


@pytest.mark.parametrize("seed", range(4))
def test_choose_ladder_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in np.clip(rng.lognormal(np.log(60), 1.2, 300), 1, 700)]
    candidates = [8, 16, 32, 64, 128, 256, 512, 1024]
    top = next(c for c in candidates if c >= max(lengths))
    below = candidates[:candidates.index(top)]
    for count in (1, 2, 3, 5):
        ladder = choose_ladder(lengths, count, smallest=8, largest=1024)
        assert ladder[-1] == top and len(ladder) <= count
        best = min(_ladder_cost(lengths, (*c, top)) for k in range(count)
                   for c in itertools.combinations(below, k))
        assert _ladder_cost(lengths, ladder) == best
    assert choose_ladder([5000, 3], 2, largest=4096) == (32, 4096)  # longer ones are truncated
    with pytest.raises(ValueError, match="choose_ladder"):
        choose_ladder([], 2)


def test_config_tail_splits_is_validated_and_reaches_the_batcher():
    with pytest.raises(ConfigError, match="shapes.tail_splits=-1"):
        load(data={"shapes": {"tail_splits": -1}})
    cfg = load(data={"shapes": {"tail_splits": 2}, "learner": {"token_budget": 64}})
    assert Batcher(cfg.learner, cfg.shapes, Metrics()).policy.tail_splits == 2


@pytest.mark.parametrize("loss_agg", ["token_mean", "sequence_mean", "token_sum"])
def test_batcher_with_tail_shapes_matches_the_reference(loss_agg):
    """The data path is the same with tail shapes: every token, weight and advantage where the
    slow reference puts it; shapes from the policy; fewer slots than without the tail."""
    rng = np.random.default_rng(0)  # lengths whose last microbatches are partly filled
    groups = make_groups([list(rng.integers(1, 40, 4)) for _ in range(6)])
    cfg = LearnerConfig(groups_per_batch=6, minibatches=2, token_budget=64, loss_agg=loss_agg)
    buckets = (8, 16, 32)
    batches = [Batcher(cfg, ShapesConfig(buckets=buckets, tail_splits=tail), Metrics()).build(groups)
               for tail in (0, 2)]
    got, want = segments(batches[1]), reference(groups, cfg, buckets[-1])
    assert set(got) == set(want)
    for key, (m, t, n, mask, adv, weight) in want.items():
        minibatch, fields = got[key]
        assert minibatch == m
        np.testing.assert_array_equal(fields["tokens"], t.tokens[:n])
        np.testing.assert_array_equal(fields["positions"], np.arange(n))
        np.testing.assert_array_equal(fields["loss_mask"], mask)
        np.testing.assert_allclose(fields["advantages"], adv, atol=1e-6)
        np.testing.assert_allclose(fields["weight"], weight, rtol=1e-6)
    policy = ShapePolicy(buckets, token_budget=64, tail_splits=2)
    assert batches[1].shapes <= set(policy.shapes())
    assert batches[1].real_tokens == batches[0].real_tokens
    assert batches[1].slots < batches[0].slots


def test_unfixed_rows_pack_one_microbatch_on_the_row_ladder():
    policy = ShapePolicy((4, 8, 12))
    lengths = [11, 10, 9, 5, 6, 3, 2, 11, 7]
    (plan,) = packing.bucketed(lengths, policy)
    check_plan(lengths, [plan])
    assert plan.width == 12 and plan.rows == rows_for_count(plan.rows)
    used_rows = len({p.row for p in plan.placements})
    assert used_rows < len(lengths)  # short ones share rows


def test_per_length_shapes_follow_the_data():
    policy = ShapePolicy(LADDER, token_budget=1000)
    plans = packing.per_length([100, 300, 250, 90, 40], policy)
    assert [p.shape for p in plans] == [(3, 300), (2, 300)]
    assert packing.pad_to_max([100], policy)[0].shape == (1, 4096)


@pytest.mark.parametrize("bad", [[0], [4097], [5, -1]])
def test_bad_lengths_raise_clear_errors(bad):
    with pytest.raises(ValueError, match="packing needs 1..4096"):
        packing.bucketed(bad, ShapePolicy(LADDER, token_budget=4096))


def test_plan_step_is_per_minibatch_and_rejects_unknown_layouts():
    policy = ShapePolicy(LADDER, token_budget=4096)
    plans = packing.plan_step([[40, 50], [3000]], policy)
    assert [[p.shape for p in mb] for mb in plans] == [[(64, 64)], [(1, 4096)]]
    with pytest.raises(ValueError, match="layout 'nope'"):
        packing.plan_step([[1]], policy, "nope")


@pytest.mark.timeout(300)
def test_packing_bench_quick_reports_every_key():
    # A fresh process: the bench turns the persistent compilation cache off before JAX compiles
    # anything, so its compile counts and times are real even when this suite shares a cache.
    # The committed SmolLM2 trace (scaled to the quick ladder), a ladder chosen from it, tails.
    command = [sys.executable, "-m", "headrace.benchmarks.packing", "--quick", "--json",
               "--dist", f"trace:{TRACE}", "--ladder", "auto", "--tail-splits", "2",
               "--ways", "bucketed,pad_to_max"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    keys = {"packing_efficiency", "compiles", "compile_s", "tokens_per_s",
            "tokens_per_s_with_compile", "wall_s"}
    assert set(result) == {"bucketed", "pad_to_max", "setup"}
    setup = result.pop("setup")
    for way, values in result.items():
        assert set(values) == keys, way
        assert values["compiles"] >= 1 and values["compile_s"] > 0 and values["wall_s"] > 0
        assert 0 < values["packing_efficiency"] <= 1
    assert setup["trajectories"] == 64 and setup["buckets"][-1] == 128
    assert result["bucketed"]["compiles"] <= setup["policy_shapes"] <= 8
    assert result["pad_to_max"]["compiles"] == 1
    # one trajectory per row packs this trace at ~0.06; best fit with tail shapes at ~0.95
    assert result["bucketed"]["packing_efficiency"] >= 0.9
    assert result["pad_to_max"]["packing_efficiency"] < 0.2


def _bench():
    from headrace.benchmarks import packing

    return packing


def test_packing_bench_rejects_a_bad_lengths_file(tmp_path, capsys):
    bench = _bench()
    path = tmp_path / "lengths.txt"
    path.write_text("12\nabc\n")
    assert bench.main(["--lengths", str(path), "--json"]) == 2
    assert "lengths.txt:2: 'abc' is not a positive integer length" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--dist", "zipf"], "--dist 'zipf': lognormal, uniform, pareto or trace:FILE"),
    (["--dist", "pareto", "--alpha", "0"], "--alpha > 0"),
    (["--tail-splits", "9"], "--tail-splits 0..8")])
def test_packing_bench_rejects_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        _bench().main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_packing_bench_pareto_is_heavy_tailed_and_the_auto_ladder_fits_the_bound():
    bench = _bench()
    args = bench._parser().parse_args(["--dist", "pareto", "--median", "131"])
    lengths = bench.sample_lengths(args, np.random.default_rng(0))
    assert lengths.min() >= 16 and lengths.max() == 4096
    assert abs(np.median(lengths) - 131) < 6  # sampling error of a median of 4,096 draws
    assert np.mean(lengths) > 1.5 * np.median(lengths)  # a heavy right tail
    for tail in (0, 1, 2, 3):
        ladder = bench.auto_ladder(lengths, 4096, 4096, tail, 8)
        assert len(ShapePolicy(ladder, 4096, tail_splits=tail).shapes()) <= 8
        assert ladder[-1] == 4096
