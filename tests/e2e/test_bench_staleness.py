"""`headrace bench staleness`: the quick run prints every promised key, forced lag shows in
lag_mean, Ctrl-C stops cleanly with partial results, and the figures are computed as documented."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUN_KEYS = ("lag", "lag_updates", "correction", "seed", "final_success_rate", "success_auc", "lag_mean",
            "dropped_lag", "dropped_age", "is_ess")
SUMMARY_KEYS = ("lag", "lag_updates", "correction", "seeds", "final_success_rate_std",
                "success_auc_std", "final_success_rate_min", "success_auc_max",
                "final_success_rate", "success_auc", "lag_mean",
                "is_ess", "dropped_lag", "dropped_age", "final_ratio", "auc_ratio")


def _bench_module():
    from headrace.benchmarks import staleness

    return staleness


bench = _bench_module()


@pytest.mark.timeout(900)
def test_quick_bench_prints_every_key_and_forced_lag_shows(tmp_path):
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "bench", "staleness",
                             "--quick", "--json", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=880, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)  # stdout is exactly one JSON object
    assert not data["interrupted"]
    runs = data["runs"]
    assert {(r["lag"], r["correction"]) for r in runs} == {
        (0, "none"), (0, "truncated_is"), (2, "none"), (2, "truncated_is")}
    for run in runs:
        for key in RUN_KEYS:
            assert key in run, (key, run)
        assert run["steps"] == data["settings"]["steps"], run
        assert run["lag_updates"] == 2 * run["lag"], run  # two optimizer updates per version
        assert 0 <= run["final_success_rate"] <= 1 and 0 <= run["success_auc"] <= 1, run
        assert 0 < run["is_ess"] <= 1 + 1e-6, run
        assert run["dropped_age"] == 0, run  # max_age_s is off
        # The forced lag happened: with margin 0 every group is trained exactly k versions after
        # the weights that generated it once the learner is past version k (and none over k).
        if run["lag"] == 0:
            assert run["lag_mean"] == 0, run
        else:
            assert 1.5 <= run["lag_mean"] <= 2, run
        assert (tmp_path / f"k{run['lag']}-{run['correction']}-s0" / "summary.json").exists()
    ess = {(r["lag"], r["correction"]): r["is_ess"] for r in runs}
    for correction in ("none", "truncated_is"):  # stale data: importance weights spread out
        assert ess[(2, correction)] < ess[(0, correction)], ess
    rows = data["summary"]
    assert len(rows) == 4
    for row in rows:
        for key in SUMMARY_KEYS:
            assert key in row, (key, row)
        if row["lag"] == 0:
            assert row["final_ratio"] in (1.0, None) and row["auc_ratio"] in (1.0, None), row
    targets = data["targets"]
    assert targets["lag"] == 2 and targets["threshold"] == 0.95
    measured = targets["truncated_is"]
    if measured["final_ratio"] is not None and measured["auc_ratio"] is not None:
        assert isinstance(measured["met"], bool), targets  # (k = 0 may score 0 in 8 steps)
    assert targets["decoupled"]["met"] is None  # not measured in the quick run
    assert json.loads((tmp_path / "result.json").read_text())["runs"] == runs
    assert data["settings"]["lags_updates"] == [0, 4]
    assert set(data["largest_kept_lag"]) == {"lag", "lag_updates", "corrections", "threshold"}


@pytest.mark.timeout(420)
def test_ctrl_c_stops_the_bench_cleanly_with_partial_results(tmp_path, interrupt):
    process = subprocess.Popen(
        [sys.executable, "-m", "headrace.cli", "bench", "staleness", "--json", "--seeds", "2",
         "--lags", "0", "--corrections", "none", "--steps", "100000", "--out", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        metrics = tmp_path / "k0-none-s0" / "metrics.jsonl"
        deadline = time.monotonic() + 300  # start-up and compiles, on a loaded machine
        while time.monotonic() < deadline and process.poll() is None:
            if metrics.exists() and any(json.loads(line).get("step", 0) >= 1
                                        for line in metrics.read_text().splitlines()):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the first run never trained a step")
        stdout, stderr = interrupt(process, 60, "the bench")
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 130, stderr[-3000:]
    data = json.loads(stdout)
    assert data["interrupted"] is True
    assert len(data["runs"]) == 1  # the second seed never started
    assert data["runs"][0]["stopped_by"] == "interrupted"
    assert data["runs"][0]["steps"] < 100000


def _write_run(run_dir: pathlib.Path, records: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_read_run_averages_as_documented(tmp_path):
    records = [
        {"step": 0, "buffer/depth": 3},
        {"step": 1, "staleness/lag_mean": 1.0, "is/ess": 0.5},
        {"step": 4, "staleness/lag_mean": 3.0, "is/ess": 0.7},
        {"step": 5, "staleness/lag_mean": 4.0, "is/ess": 0.9, "staleness/dropped_lag": 2},
        {"step": 6, "staleness/lag_mean": 4.0, "staleness/dropped_lag": 3},
    ]
    _write_run(tmp_path / "run", records)
    summary = {"final_success_rate": 0.5, "steps": 6, "wall_s": 1.0, "stopped_by": "max_steps",
               "eval_curve": [{"step": 2, "success_rate": 0.25}, {"step": 4, "success_rate": 0.5},
                              {"step": 6, "success_rate": 1.0},  # periodic at the last step
                              {"step": 6, "success_rate": 1.0}]}  # the final evaluation
    row = bench.read_run(tmp_path / "run", summary, lag=4)
    assert row["final_success_rate"] == 0.5
    assert row["success_auc"] == pytest.approx(0.375)  # neither the final nor step >= steps
    assert row["evals"] == 2
    assert row["lag_mean"] == pytest.approx(4.0)  # only records past version k = 4
    assert row["is_ess"] == pytest.approx(0.7)  # every trained record that has it
    assert row["dropped_lag"] == 3 and row["dropped_age"] == 0  # the last record's counters


def test_summary_ratios_and_targets():
    def run(lag, correction, seed, final, auc):
        return {"lag": lag, "correction": correction, "seed": seed, "final_success_rate": final,
                "success_auc": auc, "lag_mean": float(lag), "is_ess": 1.0, "dropped_lag": 0,
                "dropped_age": 0}

    runs = [run(0, "truncated_is", 0, 0.8, 0.5), run(0, "truncated_is", 1, 0.6, 0.3),
            run(4, "truncated_is", 0, 0.7, 0.4), run(4, "truncated_is", 1, 0.7, 0.4),
            run(0, "decoupled", 0, 0.5, 0.4), run(4, "decoupled", 0, 0.5, 0.37)]
    rows = bench.summarize(runs)
    cell = {(r["lag"], r["correction"]): r for r in rows}
    assert cell[(0, "truncated_is")]["final_success_rate"] == pytest.approx(0.7)
    assert cell[(4, "truncated_is")]["final_ratio"] == pytest.approx(1.0)
    assert cell[(4, "truncated_is")]["auc_ratio"] == pytest.approx(1.0)
    assert cell[(4, "decoupled")]["auc_ratio"] == pytest.approx(0.925)
    result = bench.targets(rows, lag=4)
    assert result["truncated_is"]["met"] is True
    assert result["decoupled"]["met"] is False  # the AUC is under 95 % of k = 0
    assert bench.targets(rows, lag=16)["decoupled"]["met"] is None  # not measured
    no_base = bench.summarize([run(4, "none", 0, 0.5, 0.5)])
    assert math.isnan(no_base[0]["final_ratio"])  # no k = 0 reference to divide by


@pytest.mark.parametrize("argv, message", [
    (["--corrections", "none,bogus"], "unknown bogus"),
    (["--lags", "0,x"], "comma-separated list of integers"),
    (["--steps", "0"], "--steps=0: must be >= 1"),
])
def test_bad_arguments_are_refused_with_a_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_an_out_folder_holding_old_runs_is_refused(tmp_path, capsys):
    (tmp_path / "k0-none-s0").mkdir()  # its metrics.jsonl would be appended to
    code = bench.main(["--out", str(tmp_path), "--lags", "0", "--corrections", "none",
                       "--seeds", "1"])
    assert code == 2
    assert "already holds k0-none-s0" in capsys.readouterr().err


def test_spread_and_the_largest_lag_some_correction_keeps():
    def run(lag, correction, seed, final, auc):
        return {"lag": lag, "correction": correction, "seed": seed, "final_success_rate": final,
                "success_auc": auc, "lag_mean": float(lag), "is_ess": 1.0, "dropped_lag": 0,
                "dropped_age": 0}

    runs = [run(0, "m2po", 0, 0.8, 0.5), run(0, "m2po", 1, 0.6, 0.5),
            run(4, "m2po", 0, 0.7, 0.5), run(4, "m2po", 1, 0.7, 0.5),
            run(8, "m2po", 0, 0.7, 0.4), run(8, "m2po", 1, 0.7, 0.4),
            run(0, "dppo_mask", 0, 0.5, 0.4), run(8, "dppo_mask", 0, 0.5, 0.39),
            run(16, "dppo_mask", 0, 0.1, 0.1)]
    rows = bench.summarize(runs)
    cell = {(r["lag"], r["correction"]): r for r in rows}
    assert cell[(0, "m2po")]["final_success_rate_std"] == pytest.approx(math.sqrt(0.02))
    assert cell[(0, "m2po")]["final_success_rate_min"] == 0.6
    assert cell[(8, "m2po")]["lag_updates"] == 16
    assert math.isnan(cell[(8, "dppo_mask")]["final_success_rate_std"])  # one seed: no spread
    kept = bench.largest_kept_lag(rows)
    # m2po at 8 keeps 1.0 final but 0.8 AUC; dppo_mask keeps 1.0 / 0.975 at 8; nothing at 16
    assert kept == {"lag": 8, "lag_updates": 16, "corrections": ["dppo_mask"], "threshold": 0.95}
    assert bench.largest_kept_lag([r for r in rows if r["lag"] in (0, 16)])["lag"] is None


def test_lag_updates_become_versions_and_odd_ones_are_refused(capsys):
    args = bench.parse_args(["--lag-updates", "0,8,32"])
    assert args.lags == [0, 4, 16]
    assert bench.parse_args([]).lags == [0, 4, 8, 16]  # 0, 8, 16, 32 updates
    with pytest.raises(SystemExit):
        bench.parse_args(["--lag-updates", "3"])
    assert "multiple of 2" in capsys.readouterr().err
