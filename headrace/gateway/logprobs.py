"""The `logprobs` part of a chat response (only built when a request asks for it).

Per generated token an OpenAI entry `{token, logprob, bytes, top_logprobs}`; `top_logprobs` holds
the token's k likeliest alternatives `{token, logprob, bytes}` when the engine gave them, else [].
`token` is the token's own text with special tokens spelled out (what the template renders), so
the pieces of a reply concatenate to its markup. With alternatives each distinct id is decoded
once (20 alternatives per token name few distinct ids many times: about half the time of a
decode per entry at 512 tokens x 20), and the values leave numpy in one `tolist` each; what is
left per token is building its JSON object (~0.1 ms for 64 tokens without alternatives, ~4 ms
with 20: small beside a call's rendering and generation).
"""

from __future__ import annotations

import numpy as np


def choice_logprobs(tokenizer, tokens: np.ndarray, logps: np.ndarray,
                    tops: tuple[np.ndarray, np.ndarray] | None = None) -> dict:
    """`{"content": [...]}` for one choice's kept tokens (see the module docstring).

    Args:
      tokens: int32[T] the tokens returned; logps: float32[T] their log-probs.
      tops: (ids int32[T, k], log-probs float32[T, k]) or None.
    """
    tokens = np.asarray(tokens, np.int64)
    values = np.asarray(logps, np.float64).tolist()
    if tops is None:  # few tokens, few repeats: decoding each is as fast as sorting them out
        texts = [tokenizer.decode_markup([t]) for t in tokens.tolist()]
        return {"content": [{"token": t, "logprob": v, "bytes": list(t.encode()),
                             "top_logprobs": []} for t, v in zip(texts, values)]}
    ids = np.concatenate([tokens, np.asarray(tops[0]).ravel()])
    unique, inverse = np.unique(ids, return_inverse=True)
    texts = [tokenizer.decode_markup([u]) for u in unique.tolist()]
    entries = [(t, list(t.encode())) for t in texts]
    own = [entries[i] for i in inverse[:len(tokens)].tolist()]
    k = np.asarray(tops[0]).shape[1] if len(tokens) else 0
    alt = [entries[i] for i in inverse[len(tokens):].tolist()]
    alt_values = np.asarray(tops[1], np.float64).ravel().tolist()
    alternatives = [{"token": t, "logprob": v, "bytes": b} for (t, b), v in zip(alt, alt_values)]
    return {"content": [{"token": t, "logprob": v, "bytes": b,
                         "top_logprobs": alternatives[i * k:(i + 1) * k]}
                        for i, ((t, b), v) in enumerate(zip(own, values))]}
