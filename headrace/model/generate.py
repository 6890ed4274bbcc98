"""Generation for a user's first look at a model (`headrace generate`), through the sampler the
actors use (`Sampler`: the same KV-cache programs, the same token choice)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from headrace.model import params as params_lib
from headrace.model.dims import ModelDims
from headrace.model.sampler import Sampler, SamplerSettings


@dataclasses.dataclass(frozen=True)
class Generation:
    tokens: np.ndarray  # int32: the generated ids (a stop token, if one came, is the last)
    logprobs: np.ndarray  # float32: each one's log-prob under the sampling distribution


def bucket(length: int) -> int:
    """The power of two (at least 32) that holds `length` tokens."""
    return max(32, 1 << (int(length) - 1).bit_length())


def generate(dims: ModelDims, params, prompt_ids: Sequence[int], *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             stop_ids: Sequence[int] = (), seed: int = 0) -> Generation:
    """Continues one prompt. `temperature` 0 is greedy (argmax; log-probs then at temperature 1).

    Raises:
      ValueError: an empty prompt, a negative temperature, an id outside the vocabulary, or
        max_new_tokens < 1.
    """
    prompt = np.asarray(prompt_ids, np.int64)
    if prompt.size == 0:
        raise ValueError("the prompt has no tokens")
    if temperature < 0:
        raise ValueError(f"temperature {temperature}: must be >= 0 (0: greedy)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens {max_new_tokens}: must be >= 1")
    bad = prompt[(prompt < 0) | (prompt >= dims.vocab_size)]
    if bad.size:
        raise ValueError(f"token id {int(bad[0])} is outside the vocabulary (0..{dims.vocab_size - 1})")
    settings = SamplerSettings(temperature=temperature or 1.0, top_k=top_k, top_p=top_p,
                               max_new_tokens=max_new_tokens, stop_ids=tuple(stop_ids))
    sampler = Sampler(params_lib.graphdef(dims), settings, dims.vocab_size,
                      (bucket(prompt.size + max_new_tokens),), max_batch=1, seed=seed)
    sampler.set_params(params, 0)
    tokens, logps, _ = sampler.generate([prompt.astype(np.int32)], greedy=temperature == 0)
    return Generation(np.asarray(tokens[0], np.int32), np.asarray(logps[0], np.float32))
