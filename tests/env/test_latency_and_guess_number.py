"""The latency wrapper's three kinds, and guess_number's rules."""

import asyncio
import time

import pytest

from headrace.config import LatencyConfig
from headrace.env.guess_number import GuessNumber
from headrace.env.latency import LatencySampler, LatencyWrapper


def test_latency_kinds():
    assert LatencySampler(LatencyConfig(kind="none"))() == 0.0
    assert LatencySampler(LatencyConfig(kind="fixed", seconds=0.3))() == 0.3
    trace = LatencySampler(LatencyConfig(kind="trace", trace=(0.1, 0.2, 0.3)))
    assert [trace() for _ in range(5)] == [0.1, 0.2, 0.3, 0.1, 0.2]
    draws = [LatencySampler(LatencyConfig(kind="lognormal", seconds=2.0, sigma=0.5), seed=s)()
             for s in range(400)]
    assert all(d > 0 for d in draws)
    assert sorted(draws)[200] == pytest.approx(2.0, rel=0.15)  # the median is `seconds`


@pytest.mark.timeout(30)
def test_wrapper_delays_concurrently_without_threads():
    config = LatencyConfig(kind="fixed", seconds=0.2)

    async def run_many():
        envs = [LatencyWrapper(GuessNumber(n=8), LatencySampler(config)) for _ in range(200)]
        for i, env in enumerate(envs):
            env.reset(i)
        start = time.perf_counter()
        results = await asyncio.gather(*[env.astep("4") for env in envs])
        return time.perf_counter() - start, results

    elapsed, results = asyncio.run(run_many())
    # 200 delayed steps of 0.2 s overlap: sequentially they would take 40 s, and in threads of a
    # small pool several seconds; 10 s leaves a loaded machine room.
    assert elapsed < 10.0
    assert all(len(r) == 5 for r in results)


def test_guess_number_rules():
    env = GuessNumber(n=32, max_turns=5, turn_penalty=0.01)
    seeds = env.eval_seeds()
    assert sorted(env.secret_for(s) for s in seeds) == list(range(1, 33))
    env.reset(seeds[9])  # secret 10
    assert env.step("16")[:4] == ("lower", -0.01, False, False)
    assert env.step("8")[:4] == ("higher", -0.01, False, False)
    obs, reward, terminated, truncated, info = env.step("10")
    assert (obs, terminated, info["success"]) == ("correct", True, True)
    assert reward == pytest.approx(0.99)
    env.reset(seeds[0])
    for _ in range(4):
        assert not env.step("32")[3]
    assert env.step("32")[3]  # out of guesses: truncated
