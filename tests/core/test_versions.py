"""The trained-at forecast has one home (`headrace.versions`); its Lua mirror, which admission's
Redis script runs, gives the same answer on a real redis-server, and the learner's look-ahead
and the simulator's forecast are the same function."""

import itertools

import pytest

from headrace.versions import TRAINED_AT_LUA, batches_for, trained_at, trained_at_version

# Runs the mirror on each ARGV quintuple (version, since, queued_ahead, per_batch, every).
_EVAL_LUA = TRAINED_AT_LUA + """
local out = {}
for i = 1, #ARGV, 5 do
  local at, batches = forecast_trained_at(tonumber(ARGV[i]), tonumber(ARGV[i + 1]),
                                          tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]),
                                          tonumber(ARGV[i + 4]))
  out[#out + 1] = at
  out[#out + 1] = batches
end
return out
"""


def _cases():
    small = itertools.product((0, 3, 1000), range(4), range(1, 34), (1, 2, 3, 8), (1, 2, 3))
    cases = [(v, s % pe, q, gpb, pe) for v, s, q, gpb, pe in small]
    # values far past any run's, still exact in Lua's doubles (< 2**53)
    cases += [(2**40, 2**20 - 1, 2**41 + 7, 2**10 + 1, 2**20), (2**50, 0, 2**45, 3, 7)]
    return cases


@pytest.mark.redis
@pytest.mark.timeout(60)
def test_lua_mirror_matches_python_on_redis(redis_server):
    cases = _cases()
    client = redis_server.client()
    try:
        script = client.register_script(_EVAL_LUA)
        got = []
        for start in range(0, len(cases), 500):  # Lua's unpack limit bounds ARGV per call
            chunk = cases[start:start + 500]
            got += script(keys=[], args=[x for case in chunk for x in case])
    finally:
        client.close()
    expected = [x for v, s, q, gpb, pe in cases
                for x in (trained_at_version(v, s, q, gpb, pe), batches_for(q, gpb))]
    mismatched = [(case, got[2 * i:2 * i + 2], expected[2 * i:2 * i + 2])
                  for i, case in enumerate(cases) if got[2 * i:2 * i + 2] != expected[2 * i:2 * i + 2]]
    assert not mismatched, mismatched[:5]


def test_learner_look_ahead_is_the_batch_after_the_one_in_flight():
    """The learner gathers the next batch while a step runs: it is trained one step later, at
    the version `trained_at(v, s, 2, pe)` gives (the form the loop had inline)."""
    for v, pe in itertools.product((0, 4), (1, 2, 3, 5)):
        for s in range(pe):
            assert trained_at(v, s, 2, pe) == v + (s + 1) // pe


def test_simulator_forecast_counts_steps_from_version_zero():
    """The simulator keeps steps done, not (version, since publish): the same forecast."""
    for steps, q, gpb, pe in itertools.product(range(12), range(1, 20), (1, 4), (1, 3)):
        version, since = divmod(steps, pe)
        assert trained_at_version(0, steps, q, gpb, pe) == trained_at_version(version, since, q,
                                                                              gpb, pe)
