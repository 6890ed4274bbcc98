"""`headrace audit CONFIG | RUN_DIR`: measure every stage, size the actor pool, name the bottleneck.

The analysis is `headrace.audit.audit`'s (it reads a run folder); this module runs what it
measures: with a CONFIG, a short traced run of the user's pipeline (`measure`), and the sampler
probe (`with_probe`, `headrace.runtime.probe`) unless `--no-probe`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from collections.abc import Sequence

import numpy as np

from headrace.audit import audit
from headrace.audit.audit import Measured
from headrace.audit.probe import context_lengths, split_turn_cpu
from headrace.config import Config, ConfigError, load, replace
from headrace.runtime import train
from headrace.runtime.probe import probe


def with_probe(m: Measured) -> Measured:
    """`m` with timed sampler calls up to `actor.max_batch` rows added to its traced calls, and
    the turn-side CPU a policy call costs (`split_turn_cpu` of the probe's actor)."""
    lengths = context_lengths(m.episode_tokens, float(np.mean(m.turns)),
                              m.config.shapes.buckets[-1] - m.config.sampling.max_new_tokens)
    probed = probe(m.config, lengths)
    _, per_call_s = split_turn_cpu(probed.turns)
    return dataclasses.replace(m, calls=np.vstack([m.calls, probed.calls]),
                               probed=len(probed.calls), call_cpu_s=per_call_s)


def measure(config: Config, duration_s: float, live: bool = False) -> pathlib.Path:
    """Runs the config's pipeline for `duration_s` from its first trained step (start-up may
    take `warmup_allowance_s` more) with every group traced."""
    warmup_s = audit.warmup_allowance_s(config.sampling.precompile)

    config = replace(config, run={"trace_rate": 1.0, "eval_every": 0, "max_steps": 0,
                                  "log_every": 1, "max_train_s": duration_s,
                                  "max_wall_s": duration_s + warmup_s, "stop_at_target": False})
    summary = train(config, live=live)
    return pathlib.Path(summary["run_dir"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headrace audit", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a CONFIG to measure, or a RUN_DIR to read")
    parser.add_argument("--duration", type=float, default=60.0,
                        help="seconds of measurement after start-up (CONFIG only)")
    parser.add_argument("--target", type=float, default=0.95, help="learner utilisation to reach")
    parser.add_argument("--headroom", type=float, default=1.2, help="Little's law safety factor")
    parser.add_argument("--horizon", type=float, default=300.0,
                        help="simulated seconds per candidate pool")
    parser.add_argument("--admit-pool", action="store_true",
                        help="size staleness.max_policy_lag and buffer.capacity to each candidate "
                             "pool (the limit that admits it) instead of keeping the config's")
    parser.add_argument("--no-probe", dest="probe", action="store_false",
                        help="fit the policy-call cost to the traced calls alone (skips timing "
                             "the sampler on calls of up to actor.max_batch rows)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    source = pathlib.Path(args.source)
    if not source.exists():
        print(f"headrace audit: error: {source} does not exist (give a CONFIG or a RUN_DIR)",
              file=sys.stderr)
        return 2
    if not 0 < args.target <= 1 or args.headroom < 1 or args.duration <= 0:
        print("headrace audit: error: --target must be in (0, 1], --headroom >= 1, "
              "--duration > 0", file=sys.stderr)
        return 2
    try:
        if source.is_dir():
            run_dir = source
        else:
            run_dir = measure(load(source, args.set), args.duration)
        m = audit.read_run(run_dir)
        report = audit.analyze(run_dir, target=args.target, headroom=args.headroom,
                               duration_s=args.horizon, admit_pool=args.admit_pool,
                               measured=with_probe(m) if args.probe else m,
                               progress=lambda line: print(f"headrace audit: {line}",
                                                           file=sys.stderr, flush=True))
    except ConfigError as error:
        print(f"headrace audit: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, default=float))
        print(audit.format_report(report), file=sys.stderr)
    else:
        print(audit.format_report(report))
    return 0
