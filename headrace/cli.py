"""The `headrace` command line: parse, build the config, call the runtime. Nothing else lives here.

With `--json`, stdout carries exactly one JSON object; tables, logs and the live view go to stderr.
A user mistake (bad config, unknown environment) prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headrace", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a policy (the main job)")
    train.add_argument("config", nargs="?", help="YAML config (see examples/)")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its folder")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set learner.optimizer.lr=3e-4")
    train.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    train.add_argument("--no-live", action="store_true", help="no live terminal view")
    sft = sub.add_parser("sft", help="supervised warm-up on demonstrations (see headrace.sft)")
    sft.add_argument("config", help="YAML config (its sft section; see examples/)")
    sft.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set sft.steps=200")
    sft.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    bench = sub.add_parser("bench", help="run a benchmark (benchmarks/NAME.py)")
    bench.add_argument("name")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    simulate = sub.add_parser("simulate", help="discrete-event simulation of a planned fleet")
    simulate.add_argument("args", nargs=argparse.REMAINDER)
    audit = sub.add_parser("audit", help="latency audit and actor-pool sizing (CONFIG | RUN_DIR)")
    audit.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _fail(message: str) -> int:
    print(f"headrace: {message}", file=sys.stderr)
    return 2


def _train(args) -> int:
    from headrace.config import ConfigError, load
    from headrace.env.base import EnvError

    if args.resume and args.config:
        return _fail("give either a CONFIG or --resume RUN_DIR (whose config.yaml is used), "
                     "not both")
    if not args.config and not args.resume:
        return _fail("train needs a CONFIG file (e.g. examples/guess_number.yaml)")
    live = not args.no_live and not args.json and sys.stderr.isatty()
    try:
        if args.resume:
            from headrace.runtime import resume
            from headrace.runtime.processes import train

            summary = train(resume.load_config(args.resume, args.set), live=live,
                            resume_dir=args.resume)
        else:
            from headrace.runtime import train

            summary = train(load(args.config, args.set), live=live)
    except (ConfigError, EnvError) as error:
        return _fail(str(error))
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "eval_curve"}))
    else:
        for key in ("final_success_rate", "time_to_target_s", "learner_utilization", "steps",
                    "episodes", "wall_s", "stopped_by", "run_dir"):
            print(f"{key:>22}: {summary[key]}", file=sys.stderr)
    return 1 if summary["errors"] else 0


def _sft(args) -> int:
    from headrace import sft
    from headrace.config import ConfigError, load
    from headrace.env.base import EnvError

    try:
        summary = sft.run(load(args.config, args.set))
    except (ConfigError, EnvError, sft.SftError) as error:
        return _fail(str(error))
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "eval_curve"}))
    else:
        for key in ("demos", "steps", "final_loss", "initial_success_rate", "final_success_rate",
                    "wall_s", "run_dir"):
            print(f"{key:>22}: {summary[key]}", file=sys.stderr)
    return 0


def _bench(args) -> int:
    path = BENCHMARKS / f"{args.name}.py"
    if not path.exists():
        names = sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("_"))
        return _fail(f"no benchmark {args.name!r}; available: {', '.join(names)}")
    spec = importlib.util.spec_from_file_location(f"benchmarks.{args.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from headrace.config import ConfigError

    try:
        return int(module.main(args.args) or 0)
    except ConfigError as error:  # a setting, or what a run it made could not support
        return _fail(str(error))


def _simulate(args) -> int:
    from headrace.audit import simulate

    return int(simulate.main(args.args) or 0)


def _audit(args) -> int:
    from headrace.audit import audit

    return int(audit.main(args.args) or 0)


def _compilation_cache() -> None:
    """Reuses compiled XLA programs across runs (JAX's persistent cache), unless the user chose
    a cache directory already or set HEADRACE_COMPILE_CACHE= (empty) to turn it off."""
    import os

    directory = os.environ.get("HEADRACE_COMPILE_CACHE",
                               os.path.expanduser("~/.cache/headrace/xla"))
    if not directory or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    # Through the environment, so the processes a run spawns (learner, actors) share the cache.
    os.environ["JAX_COMPILATION_CACHE_DIR"] = directory
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    import jax

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


def main(argv: list[str] | None = None) -> int:
    _compilation_cache()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    handlers = {"train": _train, "sft": _sft, "bench": _bench, "simulate": _simulate,
                "audit": _audit}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
