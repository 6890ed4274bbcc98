"""What the vLLM tests compare against: a tiny random Llama vLLM's CPU kernels serve (head size
64) and the learner's own recomputation of log-probs (`train_step._logprobs`)."""

from __future__ import annotations

import functools

import numpy as np

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
