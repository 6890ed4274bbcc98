"""The vLLM engine serving a LoRA run (skipped without .venv-vllm; `scripts/vllm.sh test` runs it
and fails instead): a real server on a tiny random Llama's base, each published version's
adapters (and nothing else) read from a real directory weight store and registered as a PEFT
adapter.

What is checked: at lag 0 the engine's log-probs are the learner's recomputation under the
merged weights (`lora.merge`, what the learner's forward computes on the fly), and far from the
base's (the adapter is applied); a version published while requests generate does not touch them
(every token of a request is its sending version's, which the log-probs confirm token by token)
and the next request uses the new one; adapters no request names are unregistered and their
folders removed; a version holding full weights instead of adapters is refused.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from headrace.model import lora
from headrace.model import params as params_lib
from headrace.runtime.build import vllm_lora_writers
from headrace.weights.directory import DirWeightStore
from tests.engines.reference import (
    DIMS,
    LOGP_TOL,
    MAX_LEN,
    generate_across_update,
    learner_logprobs,
    started_engine,
)

pytestmark = pytest.mark.timeout(1200)
SPEC = lora.LoraSpec(8, 16.0, tuple(lora.TARGETS))
LONG = 480  # tokens of the requests an update lands in


def base_params():
    return params_lib.init(DIMS, 0)[1]


def adapters(version: int) -> dict[str, np.ndarray]:
    """A trained-looking adapter (B away from zero), different per version."""
    tree = lora.init(base_params(), SPEC, version)
    keys = iter(jax.random.split(jax.random.key(100 + version), 64))
    tree = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape), tree)
    return params_lib.to_host(tree)


def merged(version: int) -> dict[str, np.ndarray]:
    return params_lib.to_host(lora.merge(base_params(), params_lib.from_host(adapters(version)),
                                         SPEC))


@pytest.fixture(scope="module")
def served(vllm_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_lora")
    store = DirWeightStore(root / "weights", keep=8, fsync=False)
    store.publish(adapters(0), 0)
    export, adapter = vllm_lora_writers(DIMS, base_params, SPEC, store, max_len=MAX_LEN)

    with started_engine(vllm_python, store, root / "engine", max_len=MAX_LEN, new_tokens=32,
                        export=export, adapter=adapter, lora_rank=SPEC.rank) as engine:
        yield engine, store


def test_lag_zero_logprobs_are_the_merged_weights_ones(served):
    engine, _ = served
    rng = np.random.default_rng(1)
    contexts = [rng.integers(0, DIMS.vocab_size, n).tolist() for n in (4, 19, 33)]
    tokens, logps, versions = engine.generate(contexts)
    ours, base = merged(0), params_lib.to_host(base_params())
    ratios, worst, off = [], 0.0, 0.0
    for context, t, lp, v in zip(contexts, tokens, logps, versions):
        assert len(t) == len(lp) == 32 and (v == 0).all()
        recomputed = learner_logprobs(ours, context, t)
        worst = max(worst, float(np.max(np.abs(recomputed - lp))))
        off = max(off, float(np.max(np.abs(learner_logprobs(base, context, t) - lp))))
        ratios.append(np.exp(recomputed - lp))
    ratio_mean = float(np.mean(np.concatenate(ratios)))
    print(f"LoRA lag 0, fp32: is/ratio_mean {ratio_mean:.6f}, max |dlogp| {worst:.2e} "
          f"(base alone: {off:.2f}); adapter load {engine.last_load}")
    assert worst < LOGP_TOL and abs(ratio_mean - 1) < 1e-2
    assert off > 0.1  # the adapter is applied: the base alone gives other log-probs
    full = sum(a.nbytes for a in base.values())
    assert 0 < engine.last_load["bytes"] < full / 4  # adapters only reach the server


def test_a_version_published_mid_request_leaves_it_on_its_adapter(served):
    engine, store = served
    rng = np.random.default_rng(2)
    contexts = [rng.integers(0, DIMS.vocab_size, n).tolist() for n in (6, 13)]
    straddled = 0
    # A tiny model generates fast and a busy machine delays the update: requests can end during
    # it. Each attempt checks every stamp; one must see the requests outlive the update.
    for _ in range(4):
        before = engine.version
        new = before + 1
        store.publish(adapters(new), new)
        (tokens, logps, versions), _ = generate_across_update(
            engine, contexts, LONG, new, after_first_token=False)
        assert engine.version == new
        for context, t, lp, v in zip(contexts, tokens, logps, versions):
            assert len(t) == LONG and (v == before).all()  # the sending version's, to the end
            np.testing.assert_allclose(learner_logprobs(merged(before), context, t), lp,
                                       atol=LOGP_TOL)
        # the folders are those of the registered adapters (no update since the one above)
        registered = {f.name for f in engine.workdir.glob("adapter-v*")}
        assert registered == {f"adapter-v{v}" for v in engine._adapters}, registered
        if before in engine._adapters:  # requests still named it at the update: kept
            assert engine._adapters == {before, new}
            straddled += 1
            break
    assert straddled, "no update landed while its requests generated in 4 attempts"
    later_tokens, later_logps, later = engine.generate([contexts[0]])
    assert (later[0] == new).all()
    np.testing.assert_allclose(learner_logprobs(merged(new), contexts[0], later_tokens[0]),
                               later_logps[0], atol=LOGP_TOL)
    # nothing names the old adapter now: the next update unregisters it
    store.publish(adapters(new + 1), new + 1)
    engine.load_version(new + 1)
    assert {f.name for f in engine.workdir.glob("adapter-v*")} == {f"adapter-v{new + 1}"}
    assert engine.last_load["adapters"] == 1


def test_full_weights_where_adapters_belong_are_refused(served):
    engine, store = served
    version = engine.version + 1
    store.publish(params_lib.to_host(base_params()), version)
    with pytest.raises(lora.AdapterError, match="full weights"):
        engine.load_version(version)
    assert engine.version == version - 1  # the engine keeps generating with what it had
    tokens, _, versions = engine.generate([[1, 2, 3]])
    assert len(tokens[0]) == 32 and (versions[0] == version - 1).all()
