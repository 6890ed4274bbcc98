"""Group-relative advantages (host side, NumPy): one scalar per trajectory.

`grpo` centres each reward on its group's mean (Shao et al. 2024, DeepSeekMath); `rloo` on the
mean of the other members (Ahmadian et al. 2024). Division by the group's std is optional and off by
default: on tasks where a group's episodes often play out alike it inflates noise and stalls
learning. Trajectories marked invalid (status error) get advantage 0 and stay out of the baseline.
A group whose valid members' rewards are all equal teaches nothing under either baseline
(`uniform`; `learner.drop_uniform_groups` drops such groups before they take a batch's place).
"""

from __future__ import annotations

import numpy as np


def group_advantages(rewards: np.ndarray, valid: np.ndarray, kind: str,
                     std_norm: bool = False, eps: float = 1e-6) -> np.ndarray:
    """Advantages for one group's rewards (float[G]); `valid` marks members in the baseline."""
    rewards = np.asarray(rewards, np.float64)
    valid = np.asarray(valid, bool)
    out = np.zeros_like(rewards)
    n = int(valid.sum())
    if n < 2:
        return out.astype(np.float32)
    r = rewards[valid]
    if kind == "grpo":
        adv = r - r.mean()
    elif kind == "rloo":
        adv = r - (r.sum() - r) / (n - 1)
    else:
        raise ValueError(f"unknown advantage kind {kind!r}")
    if std_norm:
        adv = adv / (r.std() + eps)
    out[valid] = adv
    return out.astype(np.float32)


def uniform(rewards: np.ndarray, valid: np.ndarray) -> bool:
    """Whether the group carries no learning signal: fewer than two valid members, or their
    rewards equal to float32 resolution (a spread of at most 1e-6 of the largest magnitude, or of
    1 where that is smaller), so every advantage is 0 (std normalisation would only magnify
    rounding)."""
    r = np.asarray(rewards, np.float64)[np.asarray(valid, bool)]
    if r.size < 2:
        return True
    return float(r.max() - r.min()) <= 1e-6 * max(1.0, float(np.abs(r).max()))
