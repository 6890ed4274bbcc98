"""Checks of an AdamW update that rest on an error analysis, not on one CPU's rounding.

Adam's step m_hat / (sqrt(v_hat) + eps) is scale-free: a rounding-level difference in a small
gradient (another summation order: a mesh, another microbatching, another CPU) becomes a visible
difference in the step, up to lr per update, so two correct implementations' parameters cannot be
compared entry by entry with a fixed tolerance. What can be: the moments (each update's gradient
and its square), and each state's parameters against the Adam update of its *own* moments,
recomputed in float64 (`assert_params_follow_moments`), bias corrections taken in float32 as
optax takes them (in float64 they differ by up to 1e-5 relative: 0.999 is not a float32). The
float32 step rounds each u in about six operations and each parameter in two additions per update,
so every entry must agree to 8 eps32 per update of (|p0| + lr sum |u_t|), about twice that count
of roundings (measured: at most 1.4 such units in two updates on one CPU, every entry of every
mesh of tests/parallel/test_step.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
import optax

from headrace.model import params as params_lib

EPS32 = float(np.finfo(np.float32).eps)


def adam(opt_state) -> optax.ScaleByAdamState:
    (state,) = [s for s in jax.tree.leaves(
        opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)]
    return state


def assert_moments(got_state, want_state, scale: float) -> None:
    """Adam's mu and nu: rtol 1e-5 plus `scale` x the leaf's largest entry (a gradient summed in
    another order differs by a few ulps of its largest terms, not of itself)."""
    for name in ("mu", "nu"):
        want = params_lib.flatten(getattr(adam(want_state.opt_state), name))
        got = params_lib.flatten(getattr(adam(got_state.opt_state), name))
        for path, a in want.items():
            np.testing.assert_allclose(got[path], a, rtol=1e-5, atol=scale * np.abs(a).max(),
                                       err_msg=f"{name} {path}")


def assert_params_follow_moments(initial: dict, states: Sequence, lr: float, b1: float = 0.9,
                                 b2: float = 0.999, eps: float = 1e-8) -> None:
    """`states[-1].params` are len(states) AdamW updates (weight decay 0, constant lr) of
    `initial` (flat {path: array}), made with the moments stored after each (`states[t]`: the
    state after update t + 1), to float32 rounding."""
    def bias(b: float, t: int) -> np.float64:  # as optax computes it: in float32
        return np.float64(np.float32(1) - np.float32(b) ** np.float32(t))

    def step(opt_state, t):
        moments = adam(opt_state)
        mu, nu = (params_lib.flatten(getattr(moments, k)) for k in ("mu", "nu"))
        return {p: (mu[p].astype(np.float64) / bias(b1, t))
                / (np.sqrt(nu[p].astype(np.float64) / bias(b2, t)) + eps) for p in mu}

    steps = [step(s.opt_state, t) for t, s in enumerate(states, start=1)]
    final = params_lib.flatten(states[-1].params)
    for path, p0 in initial.items():
        p0 = np.asarray(p0, np.float64)
        want = p0 - lr * sum(u[path] for u in steps)
        size = np.abs(p0) + lr * sum(np.abs(u[path]) for u in steps)
        bound = 8 * len(states) * EPS32 * size
        error = np.abs(final[path].astype(np.float64) - want)
        assert (error <= bound).all(), (path, float(error.max()), float(bound.max()))
