"""`headrace bench utilization --quick --json` runs all three ways, prints every promised key, and
each way shows its mechanism: the sync way never has more than one batch of groups in flight and
trains on data of lag 0, the async way stays within its staleness limit, Little's law is applied
as documented. (A quick run is too short for rates: its few steps mostly compile, so utilisation
and steps per second are not compared here; the full benchmark compares them.)"""

import json
import math
import pathlib

import pytest

from tests.e2e.benchrun import run_headrace

WAY_KEYS = ("learner_utilization", "steps_per_s", "trajectories_per_s", "updates_per_trajectory",
            "lag_mean", "in_flight_mean", "dropped_lag", "warmup_s", "steal_s", "eval_curve",
            "time_to_target_s", "lag_p90", "lag_updates_mean", "lag_updates_p90", "dropped",
            "is_ess", "token_lag_updates_mean")
ROOT = pathlib.Path(__file__).resolve().parents[2]
QUICK_STEPS, QUICK_GROUPS, GROUP_SIZE = 8, 16, 8  # the utilisation bench's quick settings


@pytest.mark.timeout(1200)
def test_quick_bench_prints_every_key_and_each_way_shows_its_mechanism(tmp_path):
    result = run_headrace(["bench", "utilization", "--quick", "--json", "--noise-check",
                           "--out", str(tmp_path)], timeout_s=1180)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    settings, little = data["settings"], data["little"]
    per_batch, secrets = settings["groups_per_batch"], settings["secrets"]
    assert (secrets, settings["max_turns"]) == (16, 4)  # a task learnt within the window
    for way in ("learner_alone", "sync", "async"):
        for key in WAY_KEYS:
            assert key in data[way], (way, key)
        # Each way trains (a quick run stops at its steps; its wall-clock cap only bounds a slow
        # start) and no more than the steps it was given.
        assert 1 <= data[way]["steps"] <= QUICK_STEPS, (way, data[way])
        assert 0 <= data[way]["learner_utilization"] <= 1, (way, data[way])
        assert data[way]["updates_per_trajectory"] == settings["epochs"], (way, data[way])
    alone, sync, async_ = data["learner_alone"], data["sync"], data["async"]
    # Sync: admission lets exactly one batch of groups start at the learner's version, which
    # trains on them before the next may start: never more in flight, every group lag 0.
    assert 0 < sync["in_flight_mean"] <= per_batch, sync
    assert sync["lag_mean"] == 0 and sync["dropped_lag"] == 0, sync
    # Async: as many groups in flight as it has slots at most, within the staleness limit.
    assert little["envs_per_actor_async"] == GROUP_SIZE * QUICK_GROUPS
    assert async_["in_flight_mean"] <= QUICK_GROUPS, async_
    assert 0 <= async_["lag_mean"] <= little["max_policy_lag"], (async_, little)
    # Little's law as documented: the learner's consume rate alone x the episode latency.
    assert little["consume_groups_per_s"] == pytest.approx(alone["steps_per_s"] * per_batch)
    episode_s = settings["max_turns"] * (settings["env_latency_s"] * math.exp(0.25**2 / 2) + 0.1)
    assert little["episode_s"] == pytest.approx(episode_s)
    assert little["in_flight_groups_needed"] == pytest.approx(
        little["consume_groups_per_s"] * little["episode_s"])
    assert little["admission_window_groups"] >= little["envs_per_actor_async"] / GROUP_SIZE
    for way in ("learner_alone", "sync", "async"):
        assert data[way]["steal_s"] >= 0, (way, data[way])  # (a clock: checked in test_benchlib)
    # Learning: every way has a curve of greedy evaluations at equal updates (quick: every 2
    # steps, before the last of its 8), each point a success rate on the N secrets.
    for way in ("learner_alone", "sync", "async"):
        curve = data[way]["eval_curve"]
        assert curve, (way, data[way])
        assert [p["updates"] for p in curve] == sorted({p["updates"] for p in curve}), curve
        for point in curve:
            assert point["updates"] % (2 * settings["epochs"]) == 0, (way, point)
            assert point["updates"] < QUICK_STEPS * settings["epochs"], (way, point)
            assert 0 <= point["success"] <= 1 and round(
                point["success"] * secrets) == pytest.approx(point["success"] * secrets,
                                                             abs=1e-9), (way, point)
    # Async's pool runs batches ahead of the learner: it trains at a lag, reported in updates.
    assert async_["lag_updates_mean"] > 0, async_
    assert async_["lag_updates_p90"] > 0, async_
    assert async_["token_lag_updates_mean"] > 0, async_  # each token at the version made it
    assert sync["token_lag_updates_mean"] == 0, sync
    assert sync["lag_updates_mean"] == 0, sync
    assert set(async_["dropped"]) == {"lag", "age"}
    # every seed's drops, seed 0's first (the way's own figures are seed 0's)
    assert len(async_["seed_dropped"]) == settings["seeds"], async_
    assert async_["seed_dropped"][0] == async_["dropped"], async_
    for key in ("learning_ratio_min", "time_to_target_ratio", "figures_from", "sync_rise",
                "learning_visible", "learning_auc_ratio"):
        assert key in data, key
    assert "without injected latency" in data["figures_from"]["sync"]
    # --noise-check: sync's curve runs ran a second time, to their steps, and were compared with
    # the first by the same figures as async.
    noise = data["noise"]
    assert noise["eval_curve"] and len(noise["seed_final_success"]) == settings["seeds"], noise
    again = json.loads((tmp_path / "sync-curve-again-s0" / "summary.json").read_text())
    assert again["stopped_by"] == "max_steps", again
    for figures in (data, noise):
        ratios = figures["learning_ratios"]
        if ratios and sum(p["sync"] for p in ratios) > 0:
            assert figures["learning_auc_ratio"] == pytest.approx(
                sum(p["async"] for p in ratios) / sum(p["sync"] for p in ratios))


def _bench():
    from headrace.benchmarks import _curves

    return _curves


def _run(points, warmup_s=10.0):
    return {"warmup_s": warmup_s,
            "evals": [{"step": s, "wall_s": warmup_s + w, "success_rate": x} for s, w, x in points]}


def test_curve_is_the_seed_mean_at_shared_points_and_the_ratio_skips_the_first_quarter():
    bench = _bench()
    runs = [_run([(0, 0, 0.125), (20, 10, 0.5), (40, 20, 0.75), (60, 30, 1.0)]),
            _run([(0, 1, 0.25), (20, 11, 0.25), (40, 21, 1.0)], warmup_s=20.0)]  # 60 skipped
    curve = bench.mean_curve(runs, updates_per_step=2)
    assert curve == [{"updates": 0, "wall_s": 0.5, "success": 0.1875},
                     {"updates": 40, "wall_s": 10.5, "success": 0.375},
                     {"updates": 80, "wall_s": 20.5, "success": 0.875}]
    assert bench.time_to_target(curve, 0.8) == 20.5
    assert bench.time_to_target(curve, 0.9) is None
    sync = [{"updates": u, "wall_s": 0.0, "success": x}
            for u, x in ((0, 0.5), (40, 0.5), (80, 0.9), (120, 1.0))]
    ratio, points = bench.learning_ratio(curve, sync)
    # shared updates 0, 40, 80: the first quarter (<= 20) is left out; 0.375 / 0.5 is the least
    assert [p["updates"] for p in points] == [40, 80]
    assert ratio == pytest.approx(0.75)
    assert bench.learning_ratio(curve, [{"updates": 7, "wall_s": 0, "success": 1}]) == (None, [])
    # what sync learnt to compare against: its best compared point (0.9 at 80) over its first
    assert bench.sync_rise(sync, points) == pytest.approx(0.4)
    assert bench.sync_rise(sync, []) is None
    # the areas over the compared points: (0.375 + 0.875) / (0.5 + 0.9)
    assert bench.auc_ratio(points) == pytest.approx(1.25 / 1.4)
    assert bench.auc_ratio([]) is None
    assert bench.compare(curve, sync) == {"learning_ratio_min": ratio, "learning_ratios": points,
                                          "learning_auc_ratio": bench.auc_ratio(points)}


def test_lag_in_updates_is_versions_times_updates_per_version():
    bench = _bench()
    records = [{"step": i, "staleness/lag_mean": lag, "staleness/token_lag_mean": lag / 2}
               for i, lag in enumerate(range(1, 11), 1)]
    figures = bench.lag_figures(records, updates_per_version=3)
    assert figures["lag_mean"] == pytest.approx(5.5)
    assert figures["lag_p90"] == 9  # nearest rank: the 9th of 10
    assert figures["lag_updates_mean"] == pytest.approx(16.5)
    assert figures["lag_updates_p90"] == 27
    assert figures["token_lag_updates_mean"] == pytest.approx(8.25)
