import asyncio

import pytest

from tests.gateway.helpers import ScriptedEngine, Served, config_for, tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen"))


@pytest.fixture(scope="session")
def task(checkpoint):
    from headrace.runtime import build

    return build.build_task(config_for(checkpoint))


@pytest.fixture(scope="module")
def sampled(checkpoint):
    """A gateway on the real sampler (random weights at version 0), temperature 1."""
    from headrace.actor.policy import BatchedPolicy
    from headrace.gateway.runner import gateway_options, make_gateway, settings_from
    from headrace.metrics.core import Metrics
    from headrace.runtime import build

    config = config_for(checkpoint)
    task = build.build_task(config)
    graphdef, params = build.init_params(config, task)
    sampler = build.make_sampler(config, task, graphdef, seed=0, acting=True)
    sampler.set_params(params, 0)

    async def make():
        metrics = Metrics()
        policy = BatchedPolicy(sampler, metrics, max_batch=8, wait_s=0.002)
        serving = asyncio.create_task(policy.serve())
        gateway = make_gateway(config, policy, task.tokenizer, metrics,
                               settings_from(config, gateway_options(config)))
        return gateway, [serving]

    served = Served(make)
    yield served
    served.stop()
    sampler.close()


@pytest.fixture
def scripted(task):
    """scripted(replies, **settings) -> a Served gateway whose policy answers `replies`."""
    from headrace.gateway.service import Gateway, Settings
    from headrace.metrics.core import Metrics

    made = []

    def make_served(replies, token="", **settings):
        engine = ScriptedEngine(task.tokenizer, replies)

        async def make():
            return Gateway(engine, task.tokenizer, Metrics(), Settings(**settings)), []

        served = Served(make, token=token)
        served.engine = engine
        made.append(served)
        return served

    yield make_served
    for served in made:
        served.stop()
