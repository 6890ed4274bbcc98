"""End-to-end traces (traces.jsonl, stages.json, trace/* metrics) and `headrace audit` on them."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from headrace.actor.actor import traced
from headrace.audit import audit, probe
from headrace.audit.hint import sizing_hint
from headrace.config import load, replace
from headrace.metrics.traces import GROUP_STAGES
from headrace.weights.directory import DirWeightStore

ORDER = ("requested", "admitted", "started", "finished", "put", "got", "gated", "train_started",
         "train_finished", "published", "picked_up")


def tiny(run_dir, **run):
    return load(data={
        "run": {"dir": str(run_dir), "launcher": "threads", "max_steps": 8, "eval_every": 0,
                "log_every": 1, "trace_rate": 1.0, **run},
        "env": {"name": "guess_number", "kwargs": {"n": 8, "max_turns": 3}},
        "model": {"max_len": 64},
        "sampling": {"max_new_tokens": 1, "constrain_to_actions": True},
        "actor": {"envs_per_actor": 32, "max_batch": 64},
        "learner": {"groups_per_batch": 2, "minibatches": 1},
        "buffer": {"capacity": 8},
        "weights": {"backend": "dir"},
        "shapes": {"buckets": [4, 8, 12]},
    })


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    from headrace.runtime.threads import train

    run_dir = tmp_path_factory.mktemp("traced") / "run"
    summary = train(tiny(run_dir), live=False)
    assert summary["steps"] == 8 and not summary["errors"], summary
    return run_dir


@pytest.mark.timeout(300)
def test_every_traced_group_has_every_stage_in_order(traced_run):
    lines = [json.loads(x) for x in (traced_run / "traces.jsonl").read_text().splitlines()]
    assert len(lines) >= 8 * 2 - 2  # every trained group (the last publish may beat a pickup)
    picked = [t for t in lines if t["stages"]["picked_up"] is not None]
    assert len(picked) >= len(lines) // 2
    for trace in lines:
        stages = trace["stages"]
        times = [stages[k] for k in ORDER if stages.get(k) is not None]
        assert len(times) >= len(ORDER) - 1, stages
        assert times == sorted(times), stages
        assert trace["lag"] == trace["trained_version"] - trace["oldest_version"] >= 0
        assert len(trace["episodes"]) == 8  # the group's G episodes
        for episode in trace["episodes"]:
            assert 1 <= len(episode["inference"]) <= 3
            assert len(episode["env"]) == len(episode["inference"])
            for requested, started, finished, rows in episode["inference"]:
                assert requested <= finished and started <= finished and rows >= 1
        names = {name for name, _, _ in GROUP_STAGES} - {"pickup", "end_to_end"}
        assert names <= set(trace["durations"])
    stages = json.loads((traced_run / "stages.json").read_text())
    for stage in ("admission", "env_step", "inference", "buffer", "train", "pickup",
                  "end_to_end"):
        assert {"p50", "p90", "p99", "count"} <= set(stages[stage])
    record = json.loads((traced_run / "metrics.jsonl").read_text().splitlines()[-1])
    for name in ("trace/end_to_end_s_p99", "trace/env_step_s_p50", "buffer/wait_s_p90",
                 "learner/queue_s_p50", "actor/put_s_p50"):
        assert name in record, name


@pytest.mark.timeout(300)
def test_audit_of_a_run_folder_sizes_the_pool_and_plots(traced_run):
    result = subprocess.run([sys.executable, "-m", "headrace.cli", "audit", str(traced_run),
                             "--json", "--horizon", "60"],
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    rec = report["recommendation"]
    assert rec["actors"] >= 1 and rec["envs_per_actor"] % 8 == 0
    assert rec["little"]["envs_needed"] >= 8
    assert report["bottleneck"] in ("environment", "inference", "buffer", "learner",
                                    "weight sync", "actor CPU")
    assert report["rates"]["learner_consume_groups_per_s"] > 0
    # 1, 8, 32 rows (max_batch 64), 3 episodes each, a call per turn
    assert report["rates"]["inference_calls_probed"] % (3 * 3) == 0
    assert report["rates"]["inference_calls_probed"] >= 3 * 3
    assert (traced_run / "audit.png").stat().st_size > 1000
    assert json.loads((traced_run / "audit.json").read_text())["bottleneck"] == \
        report["bottleneck"]
    assert "bottleneck" in result.stderr  # the readable report
    assert f"simulating pool 1/{len(rec['sweep'])}" in result.stderr  # never a silent wait


def test_admit_pool_sizes_each_pools_limit_to_admit_it(traced_run):
    """Sized to admit each pool, the staleness limit lets twice its groups through admission
    and the buffer holds them all; the recommendation says which limit it assumed."""
    assert audit.admitting_limits(4952, 8, 16) == (77, 1248)  # 619 groups: 2 x 619 / 16 - 1
    assert audit.admitting_limits(64, 8, 16) == (4, 80)  # small pools keep the floor
    assert audit.admitting_limits(4952, 8, 16, given=9) == (9, 160)
    m = audit.read_run(traced_run)
    gpb = m.config.learner.groups_per_batch
    rec = audit.recommend(m, target=0.95, headroom=1.2, duration_s=30.0, admit_pool=True)
    for point in rec["sweep"]:
        assert point["max_policy_lag"] == audit.admitting_limits(point["envs"], 8, gpb)[0]
    assert rec["max_policy_lag"] == audit.admitting_limits(
        rec["actors"] * rec["envs_per_actor"], 8, gpb)[0]
    told: list[str] = []
    kept = audit.recommend(m, target=0.95, headroom=1.2, duration_s=30.0, progress=told.append)
    assert {p["max_policy_lag"] for p in kept["sweep"]} == {m.config.staleness.max_policy_lag}
    assert told == [f"simulating pool {i + 1}/{len(kept['sweep'])}: {p['actors']} actor(s) x "
                    f"{p['envs_per_actor']} envs, 30 simulated s"
                    for i, p in enumerate(kept["sweep"])]


def test_actor_costs_charge_each_turns_work_to_its_row(traced_run):
    """One core serves an actor's policy calls and its turns' work outside them: each row pays
    both, processes beyond the actor cores share them, and the per-actor cap is where rows alone
    keep the core 90 % busy."""
    m = dataclasses.replace(audit.read_run(traced_run),
                            calls=np.array([[1.0, 0.0042], [101.0, 0.0242]]),
                            cpu_frac=0.5, turn_cpu_frac=0.3, turns_per_s=1000.0)
    fixed, per_row = audit.actor_costs(m, 1)
    assert fixed == pytest.approx(0.004) and per_row == pytest.approx(2e-4 + 3e-4)
    cores = audit.actor_cores(m.config)
    assert audit.actor_costs(m, 2 * cores) == pytest.approx((0.008, 1e-3))
    turn_s = m.config.actor.envs_per_actor / m.turns_per_s  # 32 environments, 1,000 turns/s
    assert audit.envs_cap(m) == int(audit.ACTOR_BUSY_MAX * turn_s / per_row) // 8 * 8
    unmeasured = dataclasses.replace(m, cpu_frac=0.0, turn_cpu_frac=0.0)  # threads launcher
    assert audit.actor_costs(unmeasured, 2 * cores) == pytest.approx((0.004, 2e-4))
    spec = audit.sim_spec(m, 1, 64, 10.0)
    assert spec.actors.inference.per_row_s == pytest.approx(per_row)
    # The probe puts 0.1 ms of the turn side on each call: at 4 rows per call, 250 calls/s take
    # 0.025 of the 0.3 cores from the turns and move to the calls' fixed cost.
    split = dataclasses.replace(m, call_cpu_s=1e-4, rows_per_call=4.0)
    assert audit.turn_cost_s(split) == pytest.approx(2.75e-4)
    assert audit.actor_costs(split, 1) == pytest.approx((0.0041, 2e-4 + 2.75e-4))


def test_turn_cpu_splits_into_a_part_per_turn_and_a_part_per_call():
    """CPU = per_turn x turns/s + per_call x calls/s over the probe's loads; a load that cannot
    tell them apart leaves it all to the regressor that explains more, never a negative cost."""
    per_turn, per_call = 8e-5, 3e-4
    points = np.array([[250.0, 170.0, 0.0], [4800.0, 20.0, 0.0]])
    points[:, 2] = per_turn * points[:, 0] + per_call * points[:, 1]
    assert probe.split_turn_cpu(points) == pytest.approx((per_turn, per_call))
    same = np.array([[100.0, 50.0, 0.02], [200.0, 100.0, 0.04]])  # rows per call alike
    assert probe.split_turn_cpu(same) == pytest.approx((2e-4, 0.0))
    negative = np.array([[100.0, 100.0, 0.05], [1000.0, 100.0, 0.05]])  # per turn would be < 0
    per_turn, per_call = probe.split_turn_cpu(negative)
    assert per_turn >= 0 and per_call >= 0
    assert probe.split_turn_cpu(np.zeros((0, 3))) == (0.0, 0.0)


def test_probe_contexts_span_an_episodes_turns():
    assert probe.context_lengths(100.0, 4.0, limit=60) == (25, 50, 60, 60)
    assert probe.context_lengths(3.0, 5.0, limit=60) == (1, 2, 2, 2, 3)


def test_a_one_core_learner_runs_its_steps_stretched_to_its_cpu_per_step(traced_run):
    """Back to back, a learner on one core does its host work between steps while a step runs:
    its steps take the process's CPU per step, when that is more than the measured step."""
    m = audit.read_run(traced_run)
    mean = float(np.mean(m.step_s))
    one_core = dataclasses.replace(m, config=replace(m.config, run={"learner_cpus": [0]}),
                                   learner_cpu_s=1.25 * mean)
    assert np.mean(one_core.busy_step_s) == pytest.approx(1.25 * mean)
    assert one_core.consume_capacity == pytest.approx(m.consume_capacity / 1.25)
    assert dataclasses.replace(m, learner_cpu_s=1.25 * mean).busy_step_s == m.step_s  # unpinned
    assert dataclasses.replace(one_core, learner_cpu_s=0.5 * mean).busy_step_s == m.step_s


def test_audit_refuses_what_it_cannot_read(tmp_path):
    missing = subprocess.run([sys.executable, "-m", "headrace.cli", "audit",
                              str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr
    empty = subprocess.run([sys.executable, "-m", "headrace.cli", "audit", str(tmp_path)],
                           capture_output=True, text=True, timeout=60)
    assert empty.returncode == 2 and "config.yaml" in empty.stderr
    assert "Traceback" not in empty.stderr


@pytest.mark.timeout(120)
def test_no_tracing_writes_no_traces(tmp_path):
    from headrace.runtime.threads import train

    summary = train(tiny(tmp_path / "run", trace_rate=0.0, max_steps=2), live=False)
    assert summary["steps"] == 2
    assert not (tmp_path / "run" / "traces.jsonl").exists()


def test_trace_sampling_is_stable_and_at_the_rate():
    ids = [f"actor-{i}" for i in range(20_000)]
    share = np.mean([traced(i, 0.1) for i in ids])
    assert 0.09 < share < 0.11
    assert [traced(i, 0.1) for i in ids[:100]] == [traced(i, 0.1) for i in ids[:100]]
    assert not any(traced(i, 0.0) for i in ids[:1000])
    assert all(traced(i, 1.0) for i in ids[:1000])


def test_dir_store_pickups_first_one_wins(tmp_path):
    store = DirWeightStore(tmp_path, fsync=False)
    assert store.pickup_time(3) is None
    store.note_pickup(3, 100.5)
    store.note_pickup(3, 200.0)
    assert store.pickup_time(3) == 100.5
    assert DirWeightStore(tmp_path, fsync=False).pickup_time(3) == 100.5  # another process


def test_inference_fit_and_pool_split():
    rows = np.arange(1, 200, dtype=np.float64)
    fixed, per_row = audit.fit_inference(np.stack([rows, 0.004 + 2e-5 * rows], axis=1))
    assert fixed == pytest.approx(0.004, rel=1e-6) and per_row == pytest.approx(2e-5, rel=1e-6)
    assert audit.fit_inference(np.array([[8.0, 0.01], [8.0, 0.03]])) == pytest.approx((0.02, 0.0))
    for total in (1, 7, 100, 1000, 4097):
        actors, per = audit.split_pool(total, cap=256, group_size=8)
        assert per % 8 == 0 and per <= 256 and actors * per >= total


def test_sizing_hint_speaks_only_when_the_learner_waits(tmp_path):
    config = tiny(tmp_path)
    fed = {"learner/utilization": 0.99, "learner/step_s_p50": 0.2, "actor/group_s_p90": 5.0,
           "learner/step": 50}
    assert sizing_hint(fed, config) == ""
    starved = {**fed, "learner/utilization": 0.3}
    hint = sizing_hint(starved, config)
    # 2 groups / 0.2 s x 5 s x 1.2 = 60 groups of 8 = 480 envs against 32.
    assert "480 envs" in hint and "448 more" in hint
    # a learner that drops a third of what it takes for equal rewards takes 1.5 groups a group
    dropping = {**starved, "learner/groups": 200.0, "learner/dropped_uniform": 100.0}
    assert "720 envs" in sizing_hint(dropping, config)


def test_the_audit_sizes_for_the_groups_a_learner_drops_for_equal_rewards(traced_run):
    """With `learner.drop_uniform_groups` the actors make the dropped groups too: the learner's
    consumption, and the simulated learner's groups a step, count them."""
    m = audit.read_run(traced_run)
    assert m.uniform_drop_factor == 1.0
    dropping = dataclasses.replace(m, uniform_drop_factor=1.5)
    assert dropping.consume_capacity == pytest.approx(1.5 * m.consume_capacity)
    spec = audit.sim_spec(dropping, actors=1, envs_per_actor=16, duration_s=10.0)
    assert spec.learner.groups_per_batch == round(1.5 * m.config.learner.groups_per_batch)
