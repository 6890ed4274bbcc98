"""`env.name: gateway` on a real actor: the agent runs on the actor's loop, its sessions'
segments become the group's trajectories, exactly the tokens the gateway recorded; a failing or
silent agent ends its own episode (counted), never the actor."""

import threading
import time

import numpy as np
import pytest

from headrace.actor.actor import Actor
from headrace.buffer.memory import MemoryBuffer
from headrace.config import load
from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.runtime import build
from headrace.weights.memory import MemoryWeightStore
from tests.gateway import agents

TASKS = {"name": "reasoning_gym",
         "kwargs": {"dataset": "chain_sum", "instruction": "direct", "eval_size": 8}}


def run_actor(checkpoint, agent, groups, done=None, model_spec=None, max_new_tokens=6,
              wait_also=None, **kwargs):
    """Runs an actor until `groups` are in the buffer (or `done(metrics)`), and `wait_also()`
    where given; returns them."""
    config = load(data={
        "env": {"name": "gateway", "kwargs": {"agent": agent, "tasks": TASKS, **kwargs}},
        "model": {"init_from": model_spec or f"hf:{checkpoint}"},
        "sampling": {"max_new_tokens": max_new_tokens}, "shapes": {"buckets": [512]},
        "actor": {"envs_per_actor": 4, "group_size": 2, "max_batch": 4}})
    task = build.build_task(config)
    graphdef, params = build.init_params(config, task)
    weights = MemoryWeightStore(2)
    weights.publish(params_lib.to_host(params), 0)
    buffer, metrics, stop = MemoryBuffer(capacity=1000), Metrics(), threading.Event()
    sampler = build.make_sampler(config, task, graphdef, seed=0, acting=True)
    actor = Actor(config, "a0", task.make_env, task.tokenizer, sampler, buffer, weights, metrics,
                  stop)
    thread = threading.Thread(target=actor.run)
    thread.start()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (
                (done(metrics) if done else buffer.depth() >= groups)
                and (wait_also is None or wait_also())):
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    return [e.group for e in buffer.get(100, timeout_s=1)], metrics


@pytest.mark.timeout(240)
def test_agent_sessions_become_exact_trajectories(checkpoint):
    agents.RECORDS.clear()
    groups, metrics = run_actor(checkpoint, "tests.gateway.agents:recording_agent", 3)
    assert len(groups) >= 3
    recorded = {tuple(r["prompt_token_ids"] + r["token_ids"][0]) for r in agents.RECORDS}
    for group in groups:
        assert len(group.trajectories) == 2  # one segment per session: the history matched
        seeds = {t.task_id for t in group.trajectories}
        assert len(seeds) == 1 and group.task_id.startswith("gateway/")
        for t in group.trajectories:
            t.validate()
            assert t.status == "ok" and tuple(t.tokens.tolist()) in recorded
            assert (t.behaviour_logprobs[t.loss_mask] < 0).all()
            assert (t.policy_version[t.loss_mask] == 0).all()
            assert np.isfinite(t.reward)
    snapshot = metrics.snapshot()
    assert snapshot["gateway/requests"] >= 12 and snapshot["gateway/sessions"] >= 6
    assert snapshot.get("gateway/new_segments", 0) == 0


@pytest.mark.timeout(240)
def test_failing_and_silent_agents_end_their_episodes(checkpoint):
    groups, metrics = run_actor(checkpoint, "tests.gateway.agents:failing_agent", 4)
    statuses = {int(g.task_id.split("/")[1]) % 2: {t.status for t in g.trajectories}
                for g in groups if g.trajectories}
    assert statuses.get(0) == {"ok"}
    assert metrics.snapshot()["gateway/agent_errors"] >= 2
    def two_timeouts(metrics):
        return metrics.snapshot().get("actor/empty_groups", 0) >= 1

    groups, metrics = run_actor(checkpoint, "tests.gateway.agents:silent_agent", 1,
                                done=two_timeouts, session_timeout_s=0.5)
    snapshot = metrics.snapshot()
    assert snapshot["gateway/session_timeouts"] >= 2 and snapshot["actor/empty_groups"] >= 1
    assert groups == []  # sessions without a call leave no trajectory to write


@pytest.mark.timeout(240)
def test_agents_of_their_own_claim_sessions_and_answer(checkpoint):
    import socket

    import httpx

    with socket.socket() as s:  # a free port for the actor's gateway
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url, stop, answered, failed = f"http://127.0.0.1:{port}", threading.Event(), [], []
    dropped: list[str] = []  # reward posts the stopping gateway hung up on

    def external_agent():  # another process in real use: here a thread, over HTTP only
        while not stop.is_set():
            try:
                claimed = httpx.post(f"{url}/sessions", json={}, timeout=60)
            except httpx.HTTPError:
                time.sleep(0.2)  # not listening yet
                continue
            if claimed.status_code != 200:
                failed.append(claimed.status_code)  # the run ended while it waited: 503
                continue
            session = claimed.json()
            assert session["task"]["prompt"] and session["seed"] >= 0
            try:
                r = httpx.post(f"{session['base_url']}/chat/completions", timeout=120, json={
                    "messages": [{"role": "user", "content": session["task"]["prompt"]}]})
            except httpx.HTTPError:
                continue  # the gateway is gone (after its run ended)
            if r.status_code != 200:
                failed.append(r.status_code)  # the run ended mid-call
                continue
            text = r.json()["choices"][0]["message"]["content"] or ""
            try:
                done = httpx.post(f"{url}/sessions/{session['id']}/reward",
                                  json={"answer": text}, timeout=30)
            except httpx.HTTPError as error:  # the gateway is gone (after its run ended)
                dropped.append(repr(error))
                continue
            if done.status_code == 200:
                answered.append(done.json()["reward"])
            else:
                failed.append(done.status_code)

    agent = threading.Thread(target=external_agent, daemon=True)
    agent.start()
    try:
        # The groups land in the buffer before the agent has read its reward answers: wait for
        # both (or for the agent thread to have died, which fails below).
        groups, metrics = run_actor(
            checkpoint, None, 2, port=port,
            wait_also=lambda: len(answered) >= 4 or not agent.is_alive())
    finally:
        stop.set()
        agent.join(60)
    assert len(groups) >= 2 and len(answered) >= 4, (answered, failed, dropped)
    # the run ended mid-episode: 503 from a stopping gateway, 404 for a session it already ended
    assert set(failed) <= {404, 503}, failed  # never a 500
    for group in groups:
        assert len(group.trajectories) == 2
        assert all(t.status == "ok" and t.loss_mask.any() for t in group.trajectories)
        assert {t.reward for t in group.trajectories} <= set(answered)
