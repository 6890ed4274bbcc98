"""The weights version a group will be trained at: the one forecast that admission, its Redis
script, the simulator and the learner's look-ahead share (docs/design.md, "Admission").

With the learner at version `v`, `s` steps since its last publish, a publish every
`publish_every` steps and the group in the `b`-th batch from now (1: the next step trains it),

    trained_at = v + floor((s + b - 1) / publish_every)

and with `Q` groups ahead of it in arrival order (itself included), `b = ceil(Q / groups_per_batch)`.
`TRAINED_AT_LUA` is the same function in Lua, for scripts that decide inside Redis; a test runs
it on a real server against `trained_at_version` (Lua numbers are doubles: exact below 2**53).
"""

from __future__ import annotations


def batches_for(queued_ahead: int, groups_per_batch: int) -> int:
    """Learner steps until a group with `queued_ahead` groups ahead (itself included) is trained."""
    return -(-queued_ahead // groups_per_batch)


def too_many_ready(batches_ahead: int, step_s: float, p90_episode_s: float | None,
                   max_ready_batches: int) -> bool:
    """The ready cap (`staleness.max_ready_batches`): True when a group `batches_ahead` batches
    from training, started now, would still find more than `max_ready_batches` batches ahead of it
    once done (`batches_ahead * step_s > p90_episode_s + max_ready_batches * step_s`); False when
    the cap is off (0) or either time is unknown (None, or a step time of 0). Admission, its Redis
    script and the simulator apply it the same way."""
    return bool(max_ready_batches and p90_episode_s is not None and step_s > 0
                and batches_ahead * step_s > p90_episode_s + max_ready_batches * step_s)


def trained_at(version: int, since_publish: int, batches_ahead: int, publish_every: int) -> int:
    """The version the `batches_ahead`-th batch from now is trained at (1: the next step's)."""
    return version + (since_publish + batches_ahead - 1) // publish_every


def trained_at_version(version: int, since_publish: int, queued_ahead: int,
                       groups_per_batch: int, publish_every: int) -> int:
    """The version a group is trained at with `queued_ahead` groups ahead (itself included)."""
    return trained_at(version, since_publish, batches_for(queued_ahead, groups_per_batch),
                      publish_every)


# forecast_trained_at(version, since, queued_ahead, per_batch, every) -> trained_at, batches
TRAINED_AT_LUA = """
local function forecast_trained_at(version, since, queued_ahead, per_batch, every)
  local batches = math.floor((queued_ahead + per_batch - 1) / per_batch)
  return version + math.floor((since + batches - 1) / every), batches
end
"""
