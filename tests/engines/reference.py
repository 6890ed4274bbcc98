"""What the vLLM tests share: a tiny random Llama vLLM's CPU kernels serve (head size 64), the
learner's own recomputation of log-probs (`train_step._logprobs`) they compare against, an
engine started on it, and a generation with a weights update landing in the middle."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import time
from collections.abc import Iterator

import numpy as np

from headrace.engines.vllm_engine import VLLMEngine, VLLMSettings
from headrace.model import params as params_lib
from headrace.model.dims import ModelDims

DIMS = ModelDims(vocab_size=512, d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=256)
MAX_LEN = 512
TEMPERATURE = 0.8
# fp32 logits of a 2-layer model agree to ~1e-5 between torch and XLA kernels; 1e-3 nats leaves
# room for summation order over a 512-word softmax, far below the O(1) of a wrong version.
LOGP_TOL = 1e-3


@functools.cache
def _recompute():
    import jax

    from headrace.learner.train_step import _logprobs

    return jax.jit(lambda params, mb: _logprobs(DIMS, params, mb, TEMPERATURE, None)[0])


def learner_logprobs(flat: dict[str, np.ndarray], context, tokens) -> np.ndarray:
    """The learner's recomputation (`train_step._logprobs`) of `tokens` after `context`, under
    the full weights `flat`."""
    seq = np.concatenate([np.asarray(context), np.asarray(tokens)]).astype(np.int32)[None]
    mb = {"tokens": seq, "positions": np.arange(seq.shape[1], dtype=np.int32)[None],
          "segment_ids": np.ones_like(seq)}
    logp = _recompute()(params_lib.from_host(flat), mb)
    return np.asarray(logp[0, len(context) - 1:])  # device -> host (intended)


@contextlib.contextmanager
def started_engine(vllm_python: str, store, workdir, *, max_len: int, new_tokens: int, export,
                   **options) -> Iterator[VLLMEngine]:
    """A `VLLMEngine` for the tiny Llama whose versions `store` holds, its server started on
    version 0 (a minute or two on 2 shared cores); stopped on exit."""
    engine = VLLMEngine(VLLMSettings(TEMPERATURE, new_tokens, (), max_len),
                        store_root=store.root, spec=dataclasses.asdict(DIMS), export=export,
                        workdir=workdir, server_options=dict(python=vllm_python,
                                                             max_model_len=max_len,
                                                             start_timeout_s=600),
                        request_timeout_s=120, **options)
    try:
        engine.load_version(0)
        print(f"vLLM server ({'LoRA' if engine.adapter else 'full weights'}) ready in "
              f"{engine.server.ready_s:.1f} s")
        yield engine
    finally:
        engine.close()


def generate_across_update(engine: VLLMEngine, contexts, new_tokens: int, version: int, *,
                           after_first_token: bool):
    """Starts `contexts` generating `new_tokens` each, loads `version` once every request is
    sent (`after_first_token`: once each has received a token), and returns (what the call
    returned, whether the call was still running when the load returned)."""
    full, engine.settings = engine.settings, dataclasses.replace(engine.settings,
                                                                 max_new_tokens=new_tokens)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(engine.generate, contexts)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not call.done():
                with engine._lock:
                    counts = [len(f.tokens) for f in engine._flights.values()]
                if len(counts) == len(contexts) and (min(counts) >= 1 or not after_first_token):
                    break
                time.sleep(0.002)
            assert not call.done(), "generation ended before the update could start"
            engine.load_version(version)
            outlived = not call.done()
            return call.result(timeout=300), outlived
    finally:
        engine.settings = full
