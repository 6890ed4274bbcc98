"""Learning curves of the utilisation bench's ways: seed means at equal optimizer updates, the time
to a target, the smallest async/sync ratio, and the lag a way trained at (pure arithmetic on the
records and evaluation points the runs wrote)."""

from __future__ import annotations

import math


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]  # nearest rank


def lag_figures(trained: list[dict], updates_per_version: int) -> dict:
    """The lag a way trained at, over its logged steps (`staleness/lag_mean` of each record: the
    step's mean over its groups, each at its oldest token), in learner versions and in optimizer
    updates, and the mean over generated tokens in updates."""
    lags = [r["staleness/lag_mean"] for r in trained if "staleness/lag_mean" in r]
    mean = sum(lags) / len(lags) if lags else 0.0
    p90 = _percentile(lags, 0.9) if lags else 0.0
    # per generated token (`staleness/token_lag_mean`): later turns may be newer than the oldest
    tokens = [r["staleness/token_lag_mean"] for r in trained if "staleness/token_lag_mean" in r]
    token_mean = sum(tokens) / len(tokens) if tokens else 0.0
    return {"lag_mean": mean, "lag_p90": p90, "lag_updates_mean": mean * updates_per_version,
            "lag_updates_p90": p90 * updates_per_version,
            "token_lag_updates_mean": token_mean * updates_per_version}


def mean_curve(runs: list[dict], updates_per_step: int) -> list[dict]:
    """The seed mean at each evaluation point every run has: `updates` (optimizer updates),
    `wall_s` (seconds since the first trained step, each run's start-up left out) and
    `success` (greedy success on the fixed task set)."""
    if not runs:
        return []
    points = [{p["step"]: (p["wall_s"] - run["warmup_s"], p["success_rate"]) for p in run["evals"]}
              for run in runs]
    common = sorted(set.intersection(*(set(p) for p in points)))
    return [{"updates": step * updates_per_step,
             "wall_s": round(sum(p[step][0] for p in points) / len(points), 2),
             "success": sum(p[step][1] for p in points) / len(points)} for step in common]


def time_to_target(curve: list[dict], target: float) -> float | None:
    """Seconds from the first trained step to the first curve point at `target` (None: never)."""
    return next((p["wall_s"] for p in curve if p["success"] >= target), None)


def learning_ratio(async_curve: list[dict], sync_curve: list[dict]) -> tuple[float | None, list]:
    """The smallest async/sync success ratio at equal updates over the points past the first
    quarter of the updates both curves cover; None when no point is comparable. Where both are 0
    the ratio is 1 (neither has learned); where only sync's is 0 it is not bounded (inf)."""
    sync_at = {p["updates"]: p["success"] for p in sync_curve}
    shared = [p for p in async_curve if p["updates"] in sync_at]
    if not shared:
        return None, []
    quarter = max(p["updates"] for p in shared) / 4
    ratios = []
    for p in shared:
        if p["updates"] <= quarter:
            continue
        a, b = p["success"], sync_at[p["updates"]]
        ratios.append({"updates": p["updates"], "async": a, "sync": b,
                       "ratio": a / b if b > 0 else (1.0 if a == 0 else math.inf)})
    if not ratios:
        return None, []
    return min(r["ratio"] for r in ratios), ratios


def sync_rise(sync_curve: list[dict], ratios: list[dict]) -> float | None:
    """How far sync's success rose from its first curve point to its best compared point (from
    `learning_ratio`): the learning there is to compare async against (None: nothing compared)."""
    if not ratios or not sync_curve:
        return None
    return max(r["sync"] for r in ratios) - sync_curve[0]["success"]


def auc_ratio(ratios: list[dict]) -> float | None:
    """Async's success summed over the compared points (from `learning_ratio`) over sync's: the
    ratio of the two curves' areas there, which one noisy point moves far less than the minimum
    (None: nothing compared, or sync never above 0)."""
    sync = sum(r["sync"] for r in ratios)
    return sum(r["async"] for r in ratios) / sync if sync > 0 else None


def compare(async_curve: list[dict], sync_curve: list[dict]) -> dict:
    """`learning_ratio_min`, `learning_ratios` and `learning_auc_ratio` of one curve against
    another at equal updates (the bench's async/sync figures, and sync/sync for the noise)."""
    ratio_min, ratios = learning_ratio(async_curve, sync_curve)
    return {"learning_ratio_min": ratio_min, "learning_ratios": ratios,
            "learning_auc_ratio": auc_ratio(ratios)}
