"""The `headrace` command line: parse, build the config, call the runtime. Nothing else lives here.

With `--json`, stdout carries exactly one JSON object; tables, logs and the live view go to stderr.
A user mistake or a host that lacks what the run needs (bad or unreadable config file, unknown
environment, no usable redis-server, no sandbox for python_exec) prints one line on stderr and
exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import pathlib
import sys
import time

from headrace import xla_flags


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
    ev = sub.add_parser("eval", help="greedy and sampled success of a trained policy on "
                        "held-out tasks (headrace.runtime.evaluation)")
    ev.add_argument("path", metavar="RUN_DIR|CHECKPOINT",
                    help="a run folder (its newest weights) or RUN_DIR/checkpoints/STEP")
    ev.add_argument("--episodes", type=_positive, metavar="N",
                    help="held-out tasks per mode (default: the environment's evaluation set, "
                    "or 64)")
    ev.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    learner = sub.add_parser("learner", help="the learner side alone: run folder, Redis, "
                             "learner, evaluation, summary; actors join with `headrace actor`")
    learner.add_argument("config", nargs="?", help="YAML config (see examples/)")
    learner.add_argument("--resume", metavar="RUN_DIR", help="continue a standalone run from its "
                         "folder (its config.yaml; actors join it again with `headrace actor`)")
    learner.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="override a config key, e.g. --set buffer.host=0.0.0.0")
    learner.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    learner.add_argument("--no-live", action="store_true", help="no live terminal view")
    actor = sub.add_parser("actor", help="one actor process alone, joining a `headrace learner` "
                           "run (password: $HEADRACE_REDIS_PASSWORD)")
    actor.add_argument("config", help="the learner's YAML config (same env, model, sampling)")
    actor.add_argument("--connect", metavar="URL", default="",
                       help="the buffer's Redis, redis://[headrace@]HOST:PORT/0 (buffer.url)")
    actor.add_argument("--run-id", default="", help="the run to join (default: the newest "
                       "run a headrace learner announced on that server)")
    actor.add_argument("--name", default="", help="this actor's id: picks its buffer shard "
                       "(default: actor-HOST-PID)")
    actor.add_argument("--wait", type=float, default=300.0, metavar="SECONDS",
                       help="how long to wait for the learner to announce its run")
    actor.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key")
    bench = sub.add_parser("bench", help="run a benchmark (headrace/benchmarks/NAME.py)")
    bench.add_argument("name")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    simulate = sub.add_parser("simulate", help="discrete-event simulation of a planned fleet")
    simulate.add_argument("args", nargs=argparse.REMAINDER)
    audit = sub.add_parser("audit", help="latency audit and actor-pool sizing (CONFIG | RUN_DIR)")
    audit.add_argument("args", nargs=argparse.REMAINDER)
    export = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face folder")
    export.add_argument("target", metavar="RUN_DIR|CHECKPOINT",
                        help="a run folder (its newest checkpoint) or RUN_DIR/checkpoints/STEP")
    export.add_argument("--hf", required=True, metavar="OUT", help="the folder to write")
    export.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    export.add_argument("--merge", action="store_true",
                        help="a LoRA run: write merged full weights, not a PEFT adapter")
    export.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    plan = sub.add_parser("plan", help="learner bytes per device on a mesh, nothing allocated")
    plan.add_argument("config", help="a run YAML config or a Hugging Face config.json")
    plan.add_argument("--mesh", action="append", default=[],
                      help="e.g. data=1,fsdp=8,tensor=8 (repeatable)")
    plan.add_argument("--tokens", type=_positive, default=8192, help="tokens per device")
    plan.add_argument("--seq-len", type=_positive, default=4096, help="tokens per packed row")
    plan.add_argument("--remat", choices=("none", "block", "both"), default="both")
    plan.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    plan.add_argument("--master-dtype", choices=("float32", "bfloat16"), default="float32")
    plan.add_argument("--json", action="store_true")
    gen = sub.add_parser("generate", help="continue a prompt with a model (a first check)")
    gen.add_argument("model", metavar="MODEL", help="hf:DIR, gguf:FILE or a run folder")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompt-ids", help="raw token ids instead, e.g. 5,17,42")
    gen.add_argument("--chat", action="store_true", help="render the prompt as a user message "
                     "with the model's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--json", action="store_true",
                     help='print {"tokens": [generated ids], "text": ...} on stdout')
    serve = sub.add_parser("serve", help="the OpenAI-compatible gateway on its own (prints "
                           "its base URL first; docs/gateway.md)")
    serve.add_argument("config", metavar="CONFIG")
    serve.add_argument("--port", type=int, default=None,
                       help="port to listen on (default env.kwargs.port, else 0: any free one)")
    serve.add_argument("--record", metavar="FILE", default=None,
                       help="append each ended session's trajectories to FILE (JSON lines)")
    serve.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key")
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _export(args) -> int:
    from headrace.config import ConfigError
    from headrace.runtime.export import export_run

    try:
        summary = export_run(args.target, args.hf, args.dtype, merge=args.merge)
    except ConfigError as error:
        return _fail(str(error))
    what = f"a LoRA adapter over {summary['base']}, " if summary.get("adapter") else ""
    print(json.dumps(summary) if args.json else f"wrote {summary['out']} ({what}"
          f"{summary['family']}, {summary['dtype']}, checkpoint {summary['step']})")
    return 0


def _generate(args) -> int:
    from headrace.config import ConfigError
    from headrace.runtime.generate import run

    ids = None
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            return _fail(f"--prompt-ids {args.prompt_ids!r}: comma-separated integers, "
                         "e.g. 5,17,42")
    try:
        out = run(args.model, prompt=args.prompt, prompt_ids=ids, chat=args.chat,
                  max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  dtype=args.dtype, seed=args.seed)
    except ConfigError as error:
        return _fail(str(error))
    print(f"loaded in {out['load_s']:.1f} s; {len(out['tokens'])} tokens in "
          f"{out['generate_s']:.1f} s (compile included)", file=sys.stderr)
    if args.json:
        print(json.dumps({"tokens": out["tokens"], "text": out["text"]}))
    else:
        print(out["text"] if out["text"] is not None else " ".join(map(str, out["tokens"])))
    return 0


def _fail(message: str) -> int:
    print(f"headrace: {message}", file=sys.stderr)
    return 2


def _fail_with(error: BaseException) -> int:
    """One line for `error`: a host error's first line names where its details are (a log)."""
    from headrace.buffer.server import RedisServerError
    from headrace.env.sandbox import SandboxUnavailable

    message = str(error) or type(error).__name__
    if isinstance(error, (RedisServerError, SandboxUnavailable)):
        message = message.splitlines()[0]
    return _fail(message)


def _user_errors() -> tuple[type[BaseException], ...]:
    """What `_fail` reports in one line: mistakes in the input, or what this host lacks."""
    from headrace.buffer.server import RedisServerError
    from headrace.config import ConfigError
    from headrace.env.base import EnvError
    from headrace.env.sandbox import SandboxUnavailable

    return ConfigError, EnvError, RedisServerError, SandboxUnavailable


def _load(load, path, *args, **kwargs):
    """`load(path, ...)`, with a config file the OS will not read (permissions, not a file, not
    UTF-8) as a ConfigError that names it."""
    from headrace.config import ConfigError

    try:
        return load(path, *args, **kwargs)
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise ConfigError(f"{path}: cannot read the config file ({reason})") from None


def _config_or_resume(args, command: str):
    """The config of `headrace train` / `learner`: CONFIG's, or RUN_DIR's for --resume. Called
    inside `_launch`, whose ConfigError is the one-line mistake."""
    from headrace.config import ConfigError, load

    if args.resume and args.config:
        raise ConfigError("give either a CONFIG or --resume RUN_DIR (whose config.yaml is used), "
                          "not both")
    if not args.config and not args.resume:
        raise ConfigError(f"{command} needs a CONFIG file (e.g. examples/guess_number.yaml)")
    if args.resume:
        from headrace.runtime import resume

        return _load(resume.load_config, args.resume, args.set)
    return _load(load, args.config, args.set)


def _train(args) -> int:
    live = not args.no_live and not args.json and sys.stderr.isatty()

    def start():
        from headrace.runtime import train  # with --resume: the launcher the run started with

        config = _config_or_resume(args, "train")
        resuming = {"resume_dir": args.resume} if args.resume else {}
        return train(config, live=live, t0=args.t0, **resuming)

    return _launch(start, args.json, ("final_success_rate", "time_to_target_s",
                                      "learner_utilization", "steps", "episodes", "wall_s",
                                      "stopped_by", "run_dir"))


def _launch(start, as_json: bool, keys: tuple[str, ...]) -> int:
    """Runs a training job (`start()` returns its summary), prints the summary (one JSON object
    on stdout, or `keys` on stderr) and returns the exit status: 1 if the run had errors."""
    try:
        summary = start()
    except _user_errors() as error:
        return _fail_with(error)
    except RuntimeError as error:
        from headrace.runtime.processes import LaunchError

        if not isinstance(error, LaunchError):
            raise
        print(f"headrace: {error}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps({k: v for k, v in summary.items() if k != "eval_curve"}))
    else:
        for key in keys:
            print(f"{key:>22}: {summary[key]}", file=sys.stderr)
    return 1 if summary["errors"] else 0


def _learner(args) -> int:
    from headrace.runtime import standalone_launch as standalone

    live = not args.no_live and not args.json and sys.stderr.isatty()
    return _launch(lambda: standalone.learner(_config_or_resume(args, "learner"), live=live,
                                              resume_dir=args.resume, t0=args.t0),
                   args.json, ("final_success_rate", "learner_utilization", "steps", "episodes",
                               "wall_s", "stopped_by", "run_dir"))


def _actor(args) -> int:
    from headrace.config import load
    from headrace.runtime import standalone_launch as standalone

    try:
        standalone.actor(_load(load, args.config, args.set), connect=args.connect,
                         run_id=args.run_id, name=args.name, wait_s=args.wait)
    except _user_errors() as error:
        return _fail_with(error)
    return 0


def _sft(args) -> int:
    from headrace.config import load
    from headrace.runtime import sft
    from headrace.sft import SftError

    try:
        summary = sft.run(_load(load, args.config, args.set))
    except (*_user_errors(), SftError) as error:
        return _fail_with(error)
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "eval_curve"}))
    else:
        for key in ("demos", "steps", "final_loss", "initial_success_rate", "final_success_rate",
                    "wall_s", "run_dir"):
            print(f"{key:>22}: {summary[key]}", file=sys.stderr)
    return 0


def _eval(args) -> int:
    from headrace.runtime import evaluation

    try:
        results = evaluation.run(args.path, args.episodes)  # the progress bar: on stderr
    except evaluation.EvalError as error:
        return _fail(str(error))
    if args.json:
        print(json.dumps(results))
    else:
        for key, value in results.items():
            print(f"{key:>22}: {value}", file=sys.stderr)
    return 0


def bench_names() -> list[str]:
    """The benchmarks `headrace bench NAME` runs: the modules of `headrace.benchmarks` whose
    names do not start with "_" (those are their helpers)."""
    import pkgutil

    from headrace import benchmarks

    return sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__)
                  if not m.name.startswith("_") and not m.ispkg)


def _bench(args) -> int:
    names = bench_names()
    if args.name not in names:
        return _fail(f"no benchmark {args.name!r}; available: {', '.join(names)}")
    module = importlib.import_module(f"headrace.benchmarks.{args.name}")
    from headrace.config import ConfigError

    try:
        return int(module.main(args.args) or 0)
    except ConfigError as error:  # a setting, or what a run it made could not support
        return _fail(str(error))


def _simulate(args) -> int:
    from headrace.sim import simulate

    return int(simulate.main(args.args) or 0)


def _audit(args) -> int:
    from headrace.runtime import audit

    return int(audit.main(args.args) or 0)


def _plan(args) -> int:
    from headrace.config import ConfigError
    from headrace.parallel import plan

    try:
        print(plan.run(args.config, args.mesh, args.tokens, args.seq_len, args.remat, args.dtype,
                       args.master_dtype, args.json))
    except ConfigError as error:
        return _fail(str(error))
    return 0


def _serve(args) -> int:
    from headrace.config import load
    from headrace.gateway.app import GatewayConfigError
    from headrace.runtime import serve

    if args.port is not None and not 0 <= args.port < 65536:
        return _fail(f"--port {args.port}: a port 0-65535 (0: any free one)")
    try:
        summary = serve.serve(_load(load, args.config, args.set), port=args.port,
                              record=args.record)
    except (*_user_errors(), GatewayConfigError) as error:
        return _fail_with(error)
    for key, value in summary.items():
        print(f"{key:>30}: {value}", file=sys.stderr)
    return 0


def _compilation_cache() -> None:
    """Reuses compiled XLA programs across runs (JAX's persistent cache), unless the user chose
    a cache directory already or set HEADRACE_COMPILE_CACHE= (empty) to turn it off."""
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


def _start_time(argv: list[str] | None) -> float:
    """Where a run's wall clock starts: run as the program (`argv` from sys.argv), the process's
    start, so it includes the interpreter's and JAX's start-up; called from Python with `argv`,
    the call's (the process may be a notebook's hours old)."""
    if argv is not None:
        return time.time()
    try:
        ticks = int(pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as stat:
            boot = next(int(line.split()[1]) for line in stat if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):  # no /proc: the call's
        return time.time()


def main(argv: list[str] | None = None) -> int:
    xla_flags.use_cpu_memory_scheduler()
    _compilation_cache()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    args.t0 = _start_time(argv)
    from headrace.runtime.worker import stacks_on_signal

    stacks_on_signal()
    handlers = {"train": _train, "learner": _learner, "actor": _actor, "sft": _sft, "eval": _eval,
                "bench": _bench, "simulate": _simulate, "audit": _audit, "export": _export,
                "generate": _generate, "plan": _plan, "serve": _serve}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
