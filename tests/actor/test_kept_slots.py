"""An episode that ends gives its kept-cache slot back empty: the next episode there, under newer
weights and with the same task prompt, is sampled by the newer weights alone (its log-probs are
theirs, as the learner recomputes them)."""

import asyncio

import numpy as np

from headrace.actor.policy import BatchedPolicy
from headrace.metrics.core import Metrics
from headrace.model import params as params_lib
from headrace.model.sampler import Sampler, SamplerSettings
from tests.model.test_sampler import DIMS, full_forward_logprobs

PROMPT = np.arange(3, 12, dtype=np.int32)


def test_the_next_episode_in_a_slot_is_sampled_by_the_current_weights_alone():
    graphdef, old = params_lib.init(DIMS, seed=3)
    _, new = params_lib.init(DIMS, seed=4)
    sampler = Sampler(graphdef, SamplerSettings(temperature=1.0, max_new_tokens=1),
                      DIMS.vocab_size, buckets=(16,), max_batch=8, seed=0, episodes=1)

    async def two_episodes():
        policy = BatchedPolicy(sampler, Metrics(), max_batch=4, wait_s=0.001)
        server = asyncio.create_task(policy.serve())
        try:
            sampler.set_params(old, 0)
            with policy.episode() as slot:
                assert slot == 0
                await asyncio.wait_for(policy.act(PROMPT, slot=slot), 60)
            sampler.set_params(new, 1)
            with policy.episode() as slot:
                assert slot == 0
                return await asyncio.wait_for(policy.act(PROMPT, slot=slot), 60)
        finally:
            server.cancel()
            policy.close()

    tokens, logps, version = asyncio.run(two_episodes())
    assert version == 1
    np.testing.assert_allclose(logps, full_forward_logprobs(graphdef, new, PROMPT, tokens, 1.0),
                               atol=1e-5)  # the sampler's tolerance (tests/model/test_sampler.py)
