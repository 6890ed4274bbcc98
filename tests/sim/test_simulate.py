"""The pipeline simulation: spec loading, its parts against slow references, closed-form cases,
the aggregated model against the fine-grained one, and the command line."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import simpy

from headrace.config import ConfigError
from headrace.sim.actors import calibrate_inference, load_bucket
from headrace.sim.pipeline import Admission, Pipeline, WeightTracker
from headrace.sim.simulate import main, plot_sweep, simulate, sweep
from headrace.sim.spec import Dist, load_spec

pytestmark = pytest.mark.timeout(60)


def spec_of(**sections):
    """A small spec: 4 actors of 1 group of 2 episodes, 2 turns of ~0.5 s, a 0.2 s learner step."""
    tree = {
        "duration_s": 200.0,
        "actors": {"count": 4, "envs_per_actor": 2, "group_size": 2, "turns": 2,
                   "env_step_s": {"kind": "lognormal", "median": 0.5, "sigma": 0.3}},
        "buffer": {"capacity": 8},
        "learner": {"step_s": 0.2, "groups_per_batch": 2},
        "staleness": {"max_policy_lag": 1000},
    }
    for name, values in sections.items():
        if isinstance(values, dict):
            tree.setdefault(name, {}).update(values)
        else:
            tree[name] = values
    return load_spec(data=tree)


# --- spec ----------------------------------------------------------------------------------------


def test_spec_accepts_distribution_shorthands():
    spec = load_spec(data={"actors": {"turns": 3, "env_step_s": [0.5, 1.0, 2.0],
                                      "pickup_s": {"kind": "exponential", "mean": 0.4}}})
    assert spec.actors.turns == Dist(kind="fixed", value=3.0)
    assert spec.actors.env_step_s == Dist(kind="empirical", samples=(0.5, 1.0, 2.0))
    assert spec.actors.pickup_s.expected == pytest.approx(0.4)


@pytest.mark.parametrize("tree, words", [
    ({"actors": {"cout": 3}}, ["actors.cout", "unknown key", "count"]),
    ({"actors": {"env_step_s": {"kind": "weibull"}}}, ["actors.env_step_s.kind", "lognormal"]),
    ({"actors": {"env_step_s": {"kind": "fixed", "median": 1}}},
     ["actors.env_step_s.median", "not a parameter of kind fixed", "value"]),
    ({"learner": {"step_s": {"kind": "lognormal", "median": 1}}},
     ["learner.step_s", "needs median, sigma"]),
    ({"buffer": {"put_s": -1}}, ["buffer.put_s.value=-1", ">= 0"]),
    ({"actors": {"pickup_s": {"kind": "empirical", "samples": []}}},
     ["actors.pickup_s.samples", "non-empty"]),
    ({"actors": {"envs_per_actor": 6, "group_size": 4}}, ["actors.envs_per_actor=6", "multiple"]),
    ({"learner": {"groups_per_batch": "many"}}, ["learner.groups_per_batch", "integer"]),
    ({"staleness": 4}, ["staleness=4", "mapping"]),
    ({"model": "coarse"}, ["model='coarse'", "aggregated"]),
])
def test_spec_errors_name_the_key(tree, words):
    with pytest.raises(ConfigError) as error:
        load_spec(data=tree)
    for word in words:
        assert word in str(error.value)


def test_spec_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such spec file"):
        load_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("actors: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_spec(bad)


@pytest.mark.parametrize("dist", [
    Dist(kind="fixed", value=1.5), Dist(kind="lognormal", median=2.0, sigma=0.6),
    Dist(kind="exponential", mean=0.7), Dist(kind="empirical", samples=(1.0, 2.0, 6.0)),
])
def test_dist_samples_have_the_stated_mean(dist):
    draws = dist.sample(np.random.default_rng(0), 40_000)
    assert draws.min() >= 0
    assert draws.mean() == pytest.approx(dist.expected, rel=0.03)


# --- parts against slow references ---------------------------------------------------------------


def test_weight_tracker_matches_a_brute_force_reference():
    rng = np.random.default_rng(1)
    n, tracker = 7, WeightTracker(7, Dist(kind="exponential", mean=2.0), rng)
    published = []  # (version, pickup time per actor)
    for t in np.arange(1.0, 12.0, 1.0):
        tracker.publish(t)
        published.append((tracker.latest, tracker._ready[tracker.latest].copy()))

    def reference(actor, now):
        return max([0] + [v for v, ready in published if ready[actor] <= now])

    for now in np.arange(0.0, 30.0, 0.37):  # queries at increasing times, as the simulation does
        actor = int(rng.integers(n))
        assert tracker.version(actor, now) == reference(actor, now)
        assert list(tracker.versions(now)) == [reference(a, now) for a in range(n)]
        for need in range(1, tracker.latest + 1):
            later = [ready[a] for v, ready in published if v >= need for a in range(3)]
            expected = min([t for t in later if t > now], default=math.inf)
            if all(reference(a, now) < need for a in range(3)):
                assert tracker.reach_time(np.arange(3), need) == pytest.approx(expected)


class _Slot:
    def __init__(self, actor):
        self.actor = actor
        self.grant = None


@pytest.mark.parametrize("pickup", [0.0, 1.0])
def test_admission_admits_exactly_up_to_the_lag_limit(pickup):
    spec = spec_of(learner={"groups_per_batch": 2, "publish_every": 1},
                   staleness={"max_policy_lag": 1}, actors={"count": 3})
    env = simpy.Environment()
    weights = WeightTracker(3, Dist(kind="fixed", value=pickup), np.random.default_rng(0))
    admission = Admission(env, spec, weights)
    grants = [admission.request(_Slot(i % 3)) for i in range(8)]
    # Trained at version (0 + ceil(Q / 2) - 1) // 1 <= 0 + 1  <=>  Q <= 4 groups ahead.
    assert [g.triggered for g in grants] == [True] * 4 + [False] * 4
    admission.step_done(2, 1.0)  # learner at step 1, version 0 until it publishes: none may start
    assert sum(g.triggered for g in grants) == 4
    weights.publish(env.now)
    admission.pump()
    env.run(until=pickup + 0.5)
    assert sum(g.triggered for g in grants) == 6  # Q <= 4 again, with version 1 held
    assert [g.value for g in grants if g.triggered][-2:] == [1, 1]
    assert admission.ahead == 4  # 6 admitted, 2 trained


def test_admission_ready_cap_follows_group_time_over_step_time():
    # The same rule as the real admission (`versions.too_many_ready`): with a step of 1 s, groups
    # of 3 s (p90) and a cap of 1 batch, a group starts while ceil(Q / 2) * 1 <= 3 + 1, Q <= 8.
    spec = spec_of(learner={"groups_per_batch": 2, "publish_every": 1},
                   staleness={"max_policy_lag": 100, "max_ready_batches": 1}, actors={"count": 2})
    env = simpy.Environment()
    weights = WeightTracker(2, Dist(kind="fixed", value=0.0), np.random.default_rng(0))
    admission = Admission(env, spec, weights)
    grants = [admission.request(_Slot(i % 2)) for i in range(14)]
    assert all(g.triggered for g in grants)  # no step or group timed yet: the lag limit alone
    for _ in range(8):
        admission.finished(3.0)
    admission.step_done(2, 1.0)  # 12 ahead: ceil(13 / 2) = 7 > 4
    more = [admission.request(_Slot(0)) for _ in range(3)]
    assert not any(g.triggered for g in more)
    for _ in range(3):
        admission.step_done(2, 1.0)  # 6 ahead: the 7th and 8th may start, not the 9th
    assert [g.triggered for g in more] == [True, True, False]


def test_inference_calibration_is_exact_for_synchronised_groups():
    spec = spec_of(actors={"group_size": 4, "envs_per_actor": 4, "turns": 3, "env_step_s": 1.0,
                           "inference": {"fixed_s": 0.05, "per_row_s": 0.01}})
    latency = calibrate_inference(spec.actors, 1, np.random.default_rng(0), requests=400)
    assert latency == pytest.approx(0.05 + 4 * 0.01)  # the group's 4 episodes share every call
    spec = spec_of(actors={"group_size": 4, "envs_per_actor": 4, "turns": 3, "env_step_s": 1.0,
                           "inference": {"fixed_s": 0.05, "per_row_s": 0.01, "max_batch": 2}})
    latency = calibrate_inference(spec.actors, 1, np.random.default_rng(0), requests=400)
    # First turn: two calls of 2 (0.07 s, then 0.14 s for the second pair); the pairs then stay
    # 0.07 s apart, so turns 2 and 3 take one call each (0.07 s).
    assert latency == pytest.approx(((0.07 + 0.14) / 2 + 0.07 + 0.07) / 3, rel=0.01)


# --- closed-form cases ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["aggregated", "fine"])
def test_oversized_pool_keeps_the_learner_busy_and_the_buffer_full(model):
    # 40 slots x 1 group/~1.1 s = ~36 groups/s offered; the learner takes 2 / 0.2 s = 10 groups/s.
    report = simulate(spec_of(model=model, duration_s=120.0, actors={"count": 40}))
    assert report["learner_utilization"] > 0.97
    assert report["buffer_depth_mean"] > 7.5 and report["buffer_depth_p99"] == 8
    assert report["actor_put_blocked_frac"] > 0.5
    assert report["groups_consumed_per_s"] == pytest.approx(10.0, rel=0.03)


@pytest.mark.parametrize("model", ["aggregated", "fine"])
def test_undersized_pool_follows_littles_law(model):
    # One episode of one exponential step per group: each slot offers 1 / 1.0 groups/s, so
    # utilisation = produce rate / consume capacity = (6 / 1.0) / (4 / 0.2) = 0.3.
    spec = spec_of(model=model, duration_s=1500.0,
                   actors={"count": 6, "group_size": 1, "envs_per_actor": 1, "turns": 1,
                           "env_step_s": {"kind": "exponential", "mean": 1.0}},
                   learner={"groups_per_batch": 4, "step_s": 0.2})
    report = simulate(spec)
    assert report["groups_produced_per_s"] == pytest.approx(6.0, rel=0.05)
    assert report["learner_utilization"] == pytest.approx(0.3, rel=0.06)
    assert report["buffer_depth_mean"] < 4  # at most a batch waits
    assert report["actor_idle_frac"] == pytest.approx(0.0, abs=1e-9)
    assert report["little_actors_needed"] == pytest.approx(20, abs=1)  # 20 groups/s x 1 s


def test_zero_lag_when_weights_are_never_published():
    report = simulate(spec_of(learner={"publish_every": 10**9}, actors={"count": 10}))
    assert report["learner_steps"] > 100
    assert report["staleness_lag_max"] == 0 and report["staleness_lag_mean"] == 0
    assert report["drop_rate"] == 0 and report["weights_publishes"] == 0


def test_lag_splits_into_generation_and_queue_parts():
    report = simulate(spec_of(actors={"count": 40}))
    assert report["staleness_lag_mean"] == pytest.approx(
        report["staleness_lag_gen_mean"] + report["staleness_lag_queue_mean"])
    assert report["staleness_lag_queue_mean"] > 1  # a full buffer of 8 = 4 steps of queue


def test_slow_pickup_with_zero_lag_limit_drops_and_admission_prevents_most():
    slow = {"count": 10, "pickup_s": 1.0}
    without = simulate(spec_of(actors=slow, staleness={"max_policy_lag": 0, "admission": False}))
    with_ = simulate(spec_of(actors=slow, staleness={"max_policy_lag": 0, "admission": True}))
    assert without["drop_rate"] > 0.5
    assert with_["drop_rate"] < 0.3 * without["drop_rate"]
    assert with_["actor_admission_wait_frac"] > 0.3
    for report in (without, with_):
        assert report["staleness_lag_max"] == 0  # the gate never lets a stale group through


def test_the_gate_bounds_the_lag_and_admission_bounds_what_is_ahead():
    spec = spec_of(actors={"count": 30, "pickup_s": {"kind": "exponential", "mean": 0.3}},
                   staleness={"max_policy_lag": 2}, duration_s=100.0)
    pipe = Pipeline(spec, seed=3)
    bound = (2 + 1) * 1 * 2  # (max_policy_lag + 1) * publish_every * groups_per_batch
    seen = []
    pipe.env.process(_watch(pipe, seen))
    trace = pipe.run()
    assert max(trace.trained_lag) <= 2
    assert max(seen) <= bound and max(seen) == bound


def _watch(pipe, seen):
    while True:
        seen.append(pipe.admission.ahead)
        yield pipe.env.timeout(0.05)


# --- the aggregated model against the fine-grained one -------------------------------------------


def test_aggregated_model_agrees_with_the_fine_model_on_a_small_fleet():
    base = dict(duration_s=300.0, staleness={"max_policy_lag": 2},
                actors={"count": 6, "envs_per_actor": 8, "group_size": 4, "turns": 3,
                        "inference": {"fixed_s": 0.03, "per_row_s": 0.004},
                        "pickup_s": 0.2},
                learner={"groups_per_batch": 6, "step_s": {"kind": "lognormal", "median": 0.4,
                                                           "sigma": 0.1},
                         "publish_s": 0.05},
                buffer={"capacity": 16})
    reports = {model: [simulate(spec_of(model=model, **base), seed) for seed in (0, 1)]
               for model in ("aggregated", "fine")}

    def mean(model, key):
        return np.mean([r[key] for r in reports[model]])

    assert mean("fine", "learner_utilization") > 0.2  # a regime where everything matters
    for key, tolerance in [("learner_utilization", 0.03), ("staleness_lag_mean", 0.15),
                           ("drop_rate", 0.04), ("actor_idle_frac", 0.03),
                           ("actor_admission_wait_frac", 0.04), ("actor_inference_s", 0.006)]:
        assert mean("aggregated", key) == pytest.approx(mean("fine", key), abs=tolerance), key
    for key in ("groups_produced_per_s", "group_s_mean", "episode_s_mean"):
        assert mean("aggregated", key) == pytest.approx(mean("fine", key), rel=0.05), key


def test_load_buckets_stay_close_and_few_as_an_actor_ramps_to_thousands_of_groups():
    loads = range(1, 6001)
    assert [load_bucket(n) for n in range(1, 33)] == list(range(1, 33))
    assert max(abs(load_bucket(n) - n) / n for n in loads) <= 1 / 32
    # one calibration per bucket, each costing in proportion to its load: 16 buckets an octave
    assert len({load_bucket(n) for n in loads}) <= 32 + 16 * math.ceil(math.log2(6000 / 32))


# --- sweep, plot and the command line ------------------------------------------------------------


def test_sweep_rises_with_the_fleet_and_plots(tmp_path):
    points = sweep(spec_of(duration_s=100.0), actors=[1, 3, 6])
    assert [p["actors"] for p in points] == [1, 3, 6]
    utilisation = [p["learner_utilization"] for p in points]
    assert utilisation[0] < utilisation[1] < utilisation[2]
    path = tmp_path / "sweep.png"
    plot_sweep(points, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ConfigError, match="integer >= 1"):
        sweep(spec_of(), actors=[0])


REPORT_KEYS = {
    "model", "actors", "duration_s", "window_s", "learner_utilization", "learner_steps",
    "learner_steps_per_s", "buffer_depth_mean", "buffer_depth_p99", "groups_produced_per_s",
    "groups_consumed_per_s", "groups_dropped_per_s", "staleness_lag_mean", "staleness_lag_max",
    "staleness_lag_gen_mean", "staleness_lag_queue_mean", "staleness_age_s_p99",
    "staleness_dropped_lag", "drop_rate", "actor_idle_frac", "actor_admission_wait_frac",
    "actor_put_blocked_frac", "actor_inference_s", "episode_s_mean", "group_s_mean",
    "group_s_p90", "little_actors_needed", "weights_publishes", "seed", "wall_s", "sim_speed",
}


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("duration_s: 60\n"
                    "actors: {count: 4, envs_per_actor: 2, group_size: 2, turns: 2,\n"
                    "         env_step_s: {kind: lognormal, median: 0.5, sigma: 0.3}}\n"
                    "learner: {step_s: 0.2, groups_per_batch: 2}\n")
    return path


def test_cli_json_prints_one_object_with_the_report_keys(spec_file, capsys):
    assert main([str(spec_file), "--json", "--duration", "30", "--set", "actors.count=3"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert set(report) == REPORT_KEYS
    assert report["duration_s"] == 30 and report["actors"] == 3
    assert "learner_utilization" in err  # the table went to stderr


def test_cli_sweep_json_and_plot(spec_file, tmp_path, capsys):
    plot = tmp_path / "out.png"
    assert main([str(spec_file), "--json", "--sweep", "1,2", "--plot", str(plot)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [p["actors"] for p in result["sweep"]] == [1, 2]
    assert result["plot"] == str(plot) and plot.stat().st_size > 0


@pytest.mark.parametrize("args, words", [
    (["--set", "buffer.capacity=0"], ["buffer.capacity=0", ">= 1"]),
    (["--set", "actors.env_step_s={kind: gamma}"], ["actors.env_step_s.kind", "lognormal"]),
    (["--sweep", "10,x"], ["--sweep", "actor counts"]),
    (["--plot", "x.png"], ["--plot", "needs --sweep"]),
    (["--duration", "-5"], ["duration_s=-5", "> 0"]),
])
def test_cli_bad_spec_is_one_line_and_exit_2(spec_file, capsys, args, words):
    assert main([str(spec_file), "--json", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("headrace simulate: error: ")
    for word in words:
        assert word in err


def test_cli_missing_file_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "nope.yaml")]) == 2
    assert "no such spec file" in capsys.readouterr().err


def test_command_line_end_to_end(spec_file):
    done = subprocess.run([sys.executable, "-m", "headrace.sim.simulate", str(spec_file),
                           "--json", "--duration", "20"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model"] == "aggregated"
