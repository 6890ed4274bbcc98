"""Packing plans against a brute-force occupancy grid, the shape policy, and the packing bench."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from headrace.learner import packing
from headrace.shapes import ShapePolicy, TooLong, bucket_for, rows_for_count

LADDER = tuple(2**i for i in range(5, 13))
ROOT = pathlib.Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize("layout", list(packing.LAYOUTS))
@pytest.mark.parametrize("budget", [0, 512, 4096])
def test_plans_cover_every_trajectory_once_without_overlap(layout, budget):
    policy = ShapePolicy(LADDER, token_budget=budget)
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


@pytest.mark.timeout(240)
def test_packing_bench_quick_reports_every_key():
    # A fresh process: the bench turns the persistent compilation cache off before JAX compiles
    # anything, so its compile counts and times are real even when this suite shares a cache.
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/packing.py"), "--quick", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    keys = {"packing_efficiency", "compiles", "compile_s", "tokens_per_s",
            "tokens_per_s_with_compile", "wall_s"}
    assert set(result) == {"bucketed", "pad_to_max", "per_length"}
    for way, values in result.items():
        assert set(values) == keys, way
        assert values["compiles"] >= 1 and values["compile_s"] > 0 and values["wall_s"] > 0
        assert 0 < values["packing_efficiency"] <= 1
    assert result["bucketed"]["compiles"] <= 2  # the quick ladder has two buckets
    assert result["pad_to_max"]["compiles"] == 1
    assert result["bucketed"]["packing_efficiency"] > result["pad_to_max"]["packing_efficiency"]


def test_packing_bench_rejects_a_bad_lengths_file(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_packing", ROOT / "benchmarks/packing.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    path = tmp_path / "lengths.txt"
    path.write_text("12\nabc\n")
    assert bench.main(["--lengths", str(path), "--json"]) == 2
    assert "lengths.txt:2: 'abc' is not a positive integer length" in capsys.readouterr().err
