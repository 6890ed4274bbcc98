"""The vLLM engine against a real vLLM server (skipped without .venv-vllm; `scripts/vllm.sh test`
runs it and fails instead). One server serves the whole module (it takes about a minute to
start): a tiny random Llama whose versions live in a real directory weight store.

What is checked: generation takes token ids and returns the sampled ids with log-probs that the
learner's own recomputation matches at lag 0 (fp32); a version loaded while requests are in
flight pauses them (none is aborted: every row is generated to its full length) and every token
is stamped with the version that produced it, which the log-probs confirm token by token; a dead
server is an `EngineError`, not a hang.

Versions differ only in the unembedding (the KV cache does not depend on it), so after an update
a request's new tokens are exactly what the new version computes from the cached prefix, and the
recomputed log-probs tell the versions apart (the unembeddings are scaled so the two
distributions differ by O(1) nats per token).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np
import pytest

from headrace.engines.base import EngineError
from headrace.engines.vllm_engine import VLLMEngine
from headrace.engines.vllm_worker import export_version
from headrace.model import params as params_lib
from headrace.weights.directory import DirWeightStore
from tests.engines.reference import (
    DIMS,
    LOGP_TOL,
    generate_across_update,
    learner_logprobs,
    started_engine,
)

# The requests an update interrupts are long: a tiny model generates a token in a few ms, and on a
# loaded machine the pause lands a second or more after it is asked for. An attempt whose requests
# all ended before the pause landed is repeated with requests twice as long (up to LONGEST).
MAX_LEN = 8192
LONG = 1900
LONGEST = 7600

# The server's start (a minute or two on 2 shared cores) counts against the first test.
pytestmark = pytest.mark.timeout(1200)


def version_params(version: int) -> dict[str, np.ndarray]:
    flat = params_lib.to_host(params_lib.init(DIMS, 0)[1])
    rng = np.random.default_rng(version)
    flat["unembed.kernel"] = rng.normal(0, 0.5, flat["unembed.kernel"].shape).astype(np.float32)
    return flat


@pytest.fixture(scope="module")
def served(vllm_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    store = DirWeightStore(root / "weights", keep=8, fsync=False)
    store.publish(version_params(0), 0)

    def export(version, out):
        export_version(store, version, dataclasses.asdict(DIMS), out, max_len=MAX_LEN)

    with started_engine(vllm_python, store, root / "engine", max_len=MAX_LEN, new_tokens=48,
                        export=export) as engine:
        yield engine, store


def test_generates_from_token_ids_with_logprobs_the_learner_recomputes(served):
    engine, _ = served
    rng = np.random.default_rng(1)
    contexts = [rng.integers(0, DIMS.vocab_size, n).tolist() for n in (3, 17, 40, 9)]
    start = time.perf_counter()
    tokens, logps, versions = engine.generate(contexts)
    print(f"4 x 48 tokens in {time.perf_counter() - start:.2f} s")
    flat = version_params(0)
    ratios, worst = [], 0.0
    for context, t, lp, v in zip(contexts, tokens, logps, versions):
        assert t.dtype == np.int32 and lp.dtype == np.float32 and len(t) == len(lp) == 48
        assert (v == 0).all()
        ours = learner_logprobs(flat, context, t)
        worst = max(worst, float(np.max(np.abs(ours - lp))))
        ratios.append(np.exp(ours - lp))
    ratio_mean = float(np.mean(np.concatenate(ratios)))
    print(f"lag 0, fp32: is/ratio_mean {ratio_mean:.6f}, max |dlogp| {worst:.2e}")
    assert worst < LOGP_TOL
    assert abs(ratio_mean - 1) < 1e-2


def _generate_and_update(engine, store, contexts, version: int, new_tokens: int):
    """Publishes `version` and loads it while `contexts` generate `new_tokens` tokens (once
    each has received one); returns what the generation returned."""
    store.publish(version_params(version), version)
    return generate_across_update(engine, contexts, new_tokens, version,
                                  after_first_token=True)[0]


def test_a_version_loaded_mid_request_pauses_it_and_stamps_each_token(served):
    engine, store = served
    rng = np.random.default_rng(2)
    contexts = [rng.integers(0, DIMS.vocab_size, n).tolist() for n in (5, 11)]
    straddled, attempts, new_tokens = 0, 0, LONG
    # The pause travels client -> API server -> engine core while the engine keeps stepping;
    # on a busy machine it can land after short requests end. Each attempt checks every stamp;
    # one must see the update land inside a request.
    while not straddled and attempts < 6:
        attempts += 1
        old, new = version_params(engine.version), version_params(attempts)
        before = engine.version
        tokens, logps, versions = _generate_and_update(engine, store, contexts, attempts,
                                                       new_tokens)
        print(f"attempt {attempts}: {new_tokens} tokens, update "
              f"{engine.last_load['update_s']:.2f} s, paused after "
              f"{engine.last_load['paused_s']:.2f} s; runner counts "
              f"{engine.last_load['generated']}")
        assert engine.version == attempts
        for context, t, lp, v in zip(contexts, tokens, logps, versions):
            assert len(t) == new_tokens, "a paused request must not be aborted or cut short"
            assert (np.diff(v) >= 0).all() and set(v.tolist()) <= {before, attempts}, v
            # the stamps are right token by token: each log-prob is its stamped version's
            # (the new version's tokens condition on keys and values the old one computed:
            # identical here, since the versions differ only in the unembedding)
            mixed = np.where(v == before, learner_logprobs(old, context, t),
                             learner_logprobs(new, context, t))
            np.testing.assert_allclose(mixed, lp, atol=LOGP_TOL)
            if v[0] == before and v[-1] == attempts:  # the update landed inside this request
                straddled += 1
                first_new = int(np.argmax(v == attempts))
                wrong = learner_logprobs(new, context, t)[:first_new]
                assert np.max(np.abs(wrong - lp[:first_new])) > 0.1  # the versions differ
        new_tokens = min(2 * new_tokens, LONGEST)
    assert straddled, f"no update landed inside a request in {attempts} attempts"
    # the next call is the new version's only, and computed with its weights
    later_tokens, later_logps, later = engine.generate([contexts[0]])
    assert (later[0] == engine.version).all()
    np.testing.assert_allclose(learner_logprobs(version_params(engine.version), contexts[0],
                                                later_tokens[0]), later_logps[0], atol=LOGP_TOL)


def test_generation_ends_at_a_stop_id_which_it_keeps(served):
    engine, _ = served
    context = [7, 8, 9]
    tokens, _, _ = engine.generate([context], greedy=True)
    stop = int(tokens[0][2])  # greedy: the third token again, unless it occurs earlier
    first = next(i for i, t in enumerate(tokens[0]) if t == stop)
    full, engine.settings = engine.settings, dataclasses.replace(engine.settings,
                                                                 stop_ids=(stop,))
    try:
        stopped, logps, versions = engine.generate([context], greedy=True)
    finally:
        engine.settings = full
    assert stopped[0].tolist() == tokens[0][:first + 1].tolist()  # the stop id kept, last
    assert len(logps[0]) == len(versions[0]) == first + 1


def test_an_engine_given_a_running_server_loads_into_it_and_leaves_it_running(served):
    engine, store = served
    given = VLLMEngine(engine.settings, store_root=store.root, spec=dataclasses.asdict(DIMS),
                       export=None, workdir=engine.workdir, url=engine.url, request_timeout_s=120)
    current = engine.version
    given.load_version(current)  # through the worker extension: no export, no new server
    assert given.server is None and given.version == current
    context = [3, 1, 4, 1, 5]
    tokens, logps, versions = given.generate([context])
    assert (versions[0] == current).all()
    np.testing.assert_allclose(learner_logprobs(version_params(current), context, tokens[0]),
                               logps[0], atol=LOGP_TOL)
    given.close()
    assert engine.server.alive()
    engine.load_version(engine.version)  # the module's engine goes on with its version


def test_a_dead_server_is_an_engine_error_not_a_hang(served):
    engine, _ = served
    os.killpg(engine.server.process.pid, signal.SIGKILL)
    engine.server.process.wait(30)
    start = time.monotonic()
    with pytest.raises(EngineError, match="exited"):
        engine.generate([[1, 2, 3]])
    with pytest.raises(EngineError):
        engine.load_version(engine.version)
    assert time.monotonic() - start < 60
