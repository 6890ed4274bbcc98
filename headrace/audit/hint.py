"""The live sizing hint of `headrace train`: how many environments the measurements call for.

When the learner waits for data (utilisation under the target) this applies Little's law to the
live metrics: groups in flight needed = consume capacity (groups per batch / learner step) x group
latency (admission to the slowest episode's end) x headroom, against the environments the run has.
`headrace audit` does the same from traces, with a simulation on top; this is the one-line version.
"""

from __future__ import annotations

import math

from headrace.config import Config

TARGET = 0.95
HEADROOM = 1.2


def uniform_drop_factor(snapshot: dict[str, float]) -> float:
    """Groups the learner takes per group it trains: 1, or more where it drops groups with
    equal rewards (`learner.drop_uniform_groups`), which the actors must make too."""
    dropped = snapshot.get("learner/dropped_uniform", 0.0)
    trained = snapshot.get("learner/groups", 0.0)
    return (trained + dropped) / trained if trained > 0 else 1.0


def sizing_hint(snapshot: dict[str, float], config: Config) -> str:
    """One line for the live view, or "" when the learner is fed (or too little is measured)."""
    util = snapshot.get("learner/utilization")
    step_s = snapshot.get("learner/step_s_p50")
    group_s = snapshot.get("trace/generate_s_mean") or snapshot.get("actor/group_s_p90")
    if util is None or not step_s or not group_s or util >= TARGET \
            or snapshot.get("learner/step", 0) < 5:
        return ""
    actor = config.actor
    consume = config.learner.groups_per_batch / step_s * uniform_drop_factor(snapshot)
    needed = math.ceil(consume * group_s * HEADROOM) * actor.group_size
    have = actor.num_actors * actor.envs_per_actor
    if needed <= have:
        return (f"learner {util:.0%} busy with {have} envs, enough by Little's law "
                f"({needed}): look at admission waits (staleness limit) or actor CPU")
    more = needed - have
    return (f"learner {util:.0%} busy, buffer runs dry: Little's law calls for ~{needed} envs "
            f"({consume:.1f} groups/s x {group_s:.2f} s x {HEADROOM}); {more} more, e.g. "
            f"{math.ceil(more / actor.envs_per_actor)} more actor(s) of {actor.envs_per_actor}")
