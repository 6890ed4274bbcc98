"""`headrace bench bare`: the baseline a decoupled run must beat, a bare single-process JAX loop.

    headrace bench bare [--quick] [--json] [--config examples/guess_number.yaml] [--seeds 1]
                        [--max-wall-s 300] [--eval-every 20] [--headrace-run RUN_DIR ...]

The same algorithm as `headrace train CONFIG` on guess_number, without anything of the system
around it: one process, no buffer, no weight store, no Python environment. Each iteration rolls out
`groups_per_batch` x `group_size` episodes at once, vectorised in `jnp` (every episode's turns in
lockstep; the game's rules as array operations), then trains on them, alternating. What is the same
as the headrace run: the config (model, sampling temperature and action constraint, optimizer,
loss, advantages, entropy bonus, minibatches per step, epochs), the initial parameters
(`build.init_params`), the token layout of an episode (`<bos> start a1 hint1 a2 ...`, the plain
renderer's; the learner trains on the action tokens only), the objective (`train_step.make_loss_fn`,
the learner's own loss) and the greedy evaluation (`headrace.actor.evaluate.evaluate` on the 32
secrets, the evaluator `headrace train` runs; its time is left out of the loop's clock). What
differs: every update is on-policy (lag 0) and the rollout is batched on the device. With
`learner.drop_uniform_groups` each step rolls out batches until `groups_per_batch` groups the
learner would keep have come and trains on those (`DynamicSampling`; `rollouts_per_step`).

Reported per seed: `time_to_target_s` (seconds of the loop, compiles included, evaluations left
out, to the first greedy evaluation at `run.eval_target`), the curve (`eval_curve`: updates,
seconds, success), `iteration_s` (rollout and update of one step), `rollout_s` and `update_s` (the
two halves, timed apart once after compiling). With `--headrace-run RUN_DIR` (a finished `headrace
train` run of the same config) it also reports `headrace_over_bare`: that run's time to target over
the bare loop's (the goal is <= 1.0: decoupling should overlap what the bare loop alternates).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time

from headrace import benchlib

DEFAULT_CONFIG = benchlib.EXAMPLES / "guess_number.yaml"


class Bare:
    """The jitted rollout and update of one config (guess_number only)."""

    def __init__(self, config):
        import jax.numpy as jnp
        import numpy as np

        from headrace.learner.train_step import make_loss_fn, make_optimizer
        from headrace.runtime import build

        if config.env.name != "guess_number":
            raise SystemExit(f"headrace bench bare: env.name={config.env.name!r}; the bare loop "
                             "implements guess_number's rules in jnp, nothing else")
        learner = config.learner
        if learner.kl_coef or learner.loss.kind == "decoupled":
            raise SystemExit("headrace bench bare: learner.kl_coef and loss.kind decoupled need "
                             "a second policy the bare loop does not keep; use another loss")
        self.config = config
        self.task = build.build_task(config)
        env = self.task.make_env()
        self.n, self.turns, self.penalty = env.n, env.max_turns, env.turn_penalty
        env.close()
        tok = self.task.tokenizer
        self.bos, self.pad = tok.bos_id, tok.pad_id
        self.start, self.higher, self.lower = (int(tok.encode(w)[0])
                                               for w in ("start", "higher", "lower"))
        number_ids = np.asarray(tok.ids_of([str(i) for i in range(1, self.n + 1)]))
        value_of = np.zeros(self.task.dims.vocab_size, np.int32)
        value_of[number_ids] = np.arange(1, self.n + 1)
        self.value_of = jnp.asarray(value_of)  # token id -> the number it says (0: none)
        self.allowed_v = None
        if self.task.sampler_settings.allowed_ids is not None:
            allowed = np.zeros(self.task.dims.vocab_size, bool)
            allowed[list(self.task.sampler_settings.allowed_ids)] = True
            self.allowed_v = jnp.asarray(allowed)
        self.width = 2 + 2 * self.turns  # <bos> start, then an action and a hint per turn
        self.episodes = learner.groups_per_batch * config.actor.group_size
        self.temperature = config.sampling.temperature
        self.optimizer = make_optimizer(learner.optimizer)
        self.loss_fn = make_loss_fn(self.task.dims, learner, self.temperature, self.allowed_v)
        self.graphdef, self.params = build.init_params(config, self.task)

    def rollout(self, params, key):
        """One batch of episodes: tokens, loss mask, behaviour log-probs (aligned with tokens),
        per-episode reward, success and secret (a group's members share one); all episodes'
        turns in lockstep."""
        import jax
        import jax.numpy as jnp

        from headrace.model.distribution import policy_logits
        from headrace.model.transformer import forward, segment_mask

        b, w, g = self.episodes, self.width, self.config.actor.group_size
        key_secret, key = jax.random.split(key)
        secrets = jnp.repeat(jax.random.randint(key_secret, (b // g,), 1, self.n + 1), g)
        tokens = jnp.full((b, w), self.pad, jnp.int32).at[:, 0].set(self.bos).at[:, 1].set(
            self.start)
        behaviour = jnp.zeros((b, w), jnp.float32)
        on = jnp.zeros((b, w), bool)
        alive = jnp.ones(b, bool)
        reward = jnp.zeros(b, jnp.float32)
        positions = jnp.broadcast_to(jnp.arange(w), (b, w))
        for turn in range(self.turns):  # static: T forward passes over the fixed-width rows
            at = 2 + 2 * turn
            segments = (jnp.arange(w)[None] < at).astype(jnp.int32)  # the context so far
            logits_btv, _ = forward(self.task.dims, params, tokens, positions,
                                    segment_mask(segments))
            scaled_bv = policy_logits(logits_btv[:, at - 1], self.temperature, self.allowed_v)
            key, sub = jax.random.split(key)
            action = jax.random.categorical(sub, scaled_bv).astype(jnp.int32)
            logp = jnp.take_along_axis(jax.nn.log_softmax(scaled_bv), action[:, None], 1)[:, 0]
            tokens = tokens.at[:, at].set(jnp.where(alive, action, self.pad))
            behaviour = behaviour.at[:, at].set(jnp.where(alive, logp, 0.0))
            on = on.at[:, at].set(alive)
            guess = self.value_of[action]
            correct = alive & (guess == secrets)
            reward = reward + jnp.where(alive, -self.penalty, 0.0) + jnp.where(correct, 1.0, 0.0)
            alive = alive & ~correct
            if turn + 1 < self.turns:  # the hint, for the episodes still playing
                hint = jnp.where(secrets > guess, self.higher, self.lower)
                tokens = tokens.at[:, at + 1].set(jnp.where(alive, hint, self.pad))
        success = reward > 0
        return tokens, on, behaviour, reward, success, secrets

    def microbatch(self, tokens, on, behaviour, reward):
        """The learner's fields (`batching.TRAIN_FIELDS`) for these rows: group-mean-centred
        advantages (grpo; rloo: the others' mean) on every token, token-mean weights."""
        import jax.numpy as jnp

        g = self.config.actor.group_size
        learner = self.config.learner
        grouped = reward.reshape(-1, g)
        mean = grouped.mean(axis=1, keepdims=True)
        if learner.advantage == "rloo":
            adv = (grouped - mean) * g / (g - 1)
        else:
            adv = grouped - mean
        if learner.advantage_std_norm:
            adv = adv / (grouped.std(axis=1, keepdims=True) + 1e-6)
        adv = adv.reshape(-1)
        if learner.loss_agg == "sequence_mean":
            per_row = on / jnp.maximum(on.sum(axis=1, keepdims=True), 1)
            weight = per_row / on.shape[0]
        elif learner.loss_agg == "token_sum":  # the learner's constant: the largest bucket
            weight = on / (on.shape[0] * self.config.shapes.buckets[-1])
        else:
            weight = on / jnp.maximum(on.sum(), 1)
        return {"tokens": tokens, "positions": jnp.broadcast_to(jnp.arange(tokens.shape[1]),
                                                                 tokens.shape),
                "segment_ids": (tokens != self.pad).astype(jnp.int32),
                "behaviour_logprobs": behaviour,
                "advantages": jnp.broadcast_to(adv[:, None], tokens.shape),
                "weight": weight.astype(jnp.float32)}

    def update(self, params, opt_state, tokens, on, behaviour, reward):
        """`epochs` x `minibatches` optimizer updates on the rollout (whole groups per
        minibatch), the learner's objective."""
        import jax
        import optax

        learner = self.config.learner
        rows = tokens.shape[0] // learner.minibatches
        for _ in range(learner.epochs):
            for m in range(learner.minibatches):
                part = slice(m * rows, (m + 1) * rows)
                mb = self.microbatch(tokens[part], on[part], behaviour[part], reward[part])
                grads, _ = jax.grad(self.loss_fn, has_aux=True)(params, mb, None, None)
                updates, opt_state = self.optimizer.update(grads, opt_state, params)
                params = optax.apply_updates(params, updates)
        return params, opt_state

    def iteration(self, params, opt_state, key):
        tokens, on, behaviour, reward, success, _ = self.rollout(params, key)
        params, opt_state = self.update(params, opt_state, tokens, on, behaviour, reward)
        return params, opt_state, reward.mean(), success.mean()


class DynamicSampling:
    """`learner.drop_uniform_groups` in the bare loop, as DAPO does it: roll out batches until
    `groups_per_batch` groups have come that the learner's policy keeps (`gate.UniformDrops`:
    those whose rewards differ, and past the step's drop limit any), then train on the first that
    many (the rest are discarded: every update stays on-policy). Rollouts and the update are
    separate programs; the groups are chosen on the host."""

    def __init__(self, bare: Bare):
        import jax

        from headrace.learner.gate import UniformDrops

        self.bare = bare
        self.rollout = jax.jit(bare.rollout)
        self.update = jax.jit(bare.update)
        self.drops = UniformDrops.from_config(bare.config.learner,
                                              bare.config.learner.groups_per_batch)
        self.rollouts = 0  # rollouts run, over every step

    def compile(self, params, opt_state, key) -> None:
        import jax

        data = jax.block_until_ready(self.rollout(params, key))
        jax.block_until_ready(self.update(params, opt_state, *data[:4]))

    def gather(self, params, key):
        """(tokens, on, behaviour, reward, success) of the step's `groups_per_batch` groups,
        rolled out with `params` (as many rollouts as that takes)."""
        import jax
        import numpy as np

        g = self.bare.config.actor.group_size
        need = self.bare.config.learner.groups_per_batch
        kept: list[tuple[np.ndarray, ...]] = []
        self.drops.next_step()
        while sum(len(part[0]) for part in kept) < need * g:
            key, sub = jax.random.split(key)
            # Deliberate device->host sync: which groups to keep is decided on the host.
            tokens, on, behaviour, reward, success, _ = jax.device_get(self.rollout(params, sub))
            self.rollouts += 1
            rows = [np.arange(i, i + g) for i in range(0, len(reward), g)
                    if not self.drops.drop(reward[i:i + g], np.ones(g, bool))]
            rows = np.concatenate(rows) if rows else np.zeros(0, np.int64)
            kept.append((tokens[rows], on[rows], behaviour[rows], reward[rows], success[rows]))
        return tuple(np.concatenate(field)[:need * g] for field in zip(*kept))

    def __call__(self, params, opt_state, key):
        tokens, on, behaviour, reward, success = self.gather(params, key)
        params, opt_state = self.update(params, opt_state, tokens, on, behaviour, reward)
        return params, opt_state, reward.mean(), success.mean()


def train(config, seed: int, max_wall_s: float, eval_every: int, max_steps: int) -> dict:
    """One seed of the bare loop until the greedy target, `max_wall_s` of loop time or
    `max_steps` iterations."""
    import jax

    from headrace.actor.evaluate import eval_seeds, evaluate
    from headrace.runtime import build

    config = dataclasses.replace(config, run=dataclasses.replace(config.run, seed=seed))
    bare = Bare(config)
    dynamic = DynamicSampling(bare) if config.learner.drop_uniform_groups else None
    params, opt_state = bare.params, bare.optimizer.init(bare.params)
    sampler = build.make_sampler(config, bare.task, bare.graphdef, seed=seed + 7)
    probe = bare.task.make_env()
    seeds = eval_seeds(probe, 64)
    probe.close()
    updates_per_step = config.learner.minibatches * config.learner.epochs
    key = jax.random.key(seed)
    curve, loop_s, cpu_s, step, ttt = [], 0.0, 0.0, 0, None
    compile_start = time.perf_counter()
    if dynamic is None:
        compiled = jax.jit(bare.iteration).lower(params, opt_state, key).compile()
    else:
        dynamic.compile(params, opt_state, key)
        compiled = dynamic
    compile_s = time.perf_counter() - compile_start
    loop_s += compile_s
    while loop_s < max_wall_s and (not max_steps or step < max_steps):
        key, sub = jax.random.split(key)
        begin, cpu_begin = time.perf_counter(), time.process_time()
        params, opt_state, reward, success = compiled(params, opt_state, sub)
        # The loop's clock: one host sync per iteration (intended).
        jax.block_until_ready(params if dynamic else reward)
        loop_s += time.perf_counter() - begin
        cpu_s += time.process_time() - cpu_begin  # every thread of the process (XLA's too)
        step += 1
        if step % eval_every == 0 or (max_steps and step == max_steps):
            sampler.set_params(params, step)
            result = evaluate(bare.task.make_env, bare.task.tokenizer, sampler, seeds,
                              config.env.step_timeout_s, config.actor.max_batch)
            curve.append({"updates": step * updates_per_step, "wall_s": round(loop_s, 2),
                          "success": result["success_rate"],
                          "reward_mean": float(reward), "train_success": float(success)})
            print(f"bare seed {seed}: step {step} ({loop_s:.1f} s) greedy "
                  f"{result['success_rate']:.3f}", file=sys.stderr, flush=True)
            if result["success_rate"] >= config.run.eval_target:
                ttt = loop_s
                break
    rollout_s, update_s = _split_timings(bare, params, opt_state, key)
    return {"seed": seed, "time_to_target_s": ttt, "steps": step,
            "updates": step * updates_per_step, "loop_s": round(loop_s, 2),
            "compile_s": round(compile_s, 2),
            "iteration_s": (loop_s - compile_s) / step if step else None,
            "cpu_s_per_step": cpu_s / step if step else None,
            "cores_busy": cpu_s / (loop_s - compile_s) if loop_s > compile_s else None,
            "rollout_s": rollout_s, "update_s": update_s,
            "rollouts_per_step": dynamic.rollouts / step if dynamic and step else None,
            "final_success": curve[-1]["success"] if curve else None, "eval_curve": curve}


def _split_timings(bare: Bare, params, opt_state, key, repeats: int = 5) -> tuple[float, float]:
    """Median seconds of the rollout and of the update, each jitted alone (after compiling)."""
    import jax

    rollout = jax.jit(bare.rollout)
    update = jax.jit(bare.update)
    data = jax.block_until_ready(rollout(params, key))  # compiles
    jax.block_until_ready(update(params, opt_state, *data[:4]))
    times = {"rollout": [], "update": []}
    for _ in range(repeats):
        begin = time.perf_counter()
        data = jax.block_until_ready(rollout(params, key))
        times["rollout"].append(time.perf_counter() - begin)
        begin = time.perf_counter()
        jax.block_until_ready(update(params, opt_state, *data[:4]))
        times["update"].append(time.perf_counter() - begin)
    return _median(times["rollout"]), _median(times["update"])


def headrace_run(run_dir: pathlib.Path) -> dict:
    """A finished `headrace train` run's time to target (its summary.json) and the CPU its
    learner and actor processes spent per learner step over the steady state (metrics.jsonl:
    `learner/cpu_frac` and `learner/steps_per_s` since the first step, compiling steps left
    out; `actor/cpu_frac`, the median of its ~2 s readings, times `actor.num_actors`; under the
    threads launcher both read the one process, the learner's figure alone). The embedded Redis
    and the supervisor are not counted; None where the run has no such figures."""
    import numpy as np

    from headrace.config import ConfigError, load
    from headrace.metrics.records import read_records

    path = run_dir / "summary.json"
    if not path.is_file():
        raise SystemExit(f"headrace bench bare: --headrace-run {run_dir}: no summary.json there "
                         "(give the folder of a finished `headrace train` run)")
    try:
        config = load(run_dir / "config.yaml")
        records = read_records(run_dir)
    except (ConfigError, OSError, ValueError) as error:
        raise SystemExit(f"headrace bench bare: --headrace-run {run_dir}: {error}") from None
    last: dict = {}
    for record in records:
        last.update(record)
    readings = [r["actor/cpu_frac"] for r in records
                if "actor/cpu_frac" in r and r.get("learner/step", 0) >= 1]
    if config.run.launcher == "threads":  # both figures read the one process: the learner's
        actors = 0.0
    else:
        actors = float(np.median(readings)) * config.actor.num_actors if readings else None
    cpu_s_per_step = None
    if actors is not None and last.get("learner/cpu_frac") and last.get("learner/steps_per_s"):
        cpu_s_per_step = (last["learner/cpu_frac"] + actors) / last["learner/steps_per_s"]
    summary = json.loads(path.read_text())
    reached = [p["step"] for p in summary.get("eval_curve", [])
               if p["success_rate"] >= config.run.eval_target]
    return {"run_dir": str(run_dir), "time_to_target_s": summary.get("time_to_target_s"),
            "steps_to_target": reached[0] if reached else None, "cpu_s_per_step": cpu_s_per_step}


def _median(values: list) -> float | None:
    """The median of the values that are not None (of an even count, the mean of the middle two)."""
    done = [v for v in values if v is not None]
    return statistics.median(done) if done else None


def _ratio(headrace: list, bare: list) -> float | None:
    """Median over median; None when either side has none."""
    top, bottom = _median(headrace), _median(bare)
    return top / bottom if top and bottom else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headrace bench bare",
                                     description=__doc__.split("\n\n")[0],
                                     parents=[benchlib.bench_parser()])
    parser.add_argument("--config", type=pathlib.Path, default=DEFAULT_CONFIG,
                        help="the headrace config whose algorithm the loop runs")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, as `headrace train --set`")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1, one after another")
    parser.add_argument("--max-wall-s", type=float, default=None,
                        help="loop seconds per seed at most (default: the config's "
                             "run.max_wall_s)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="iterations between greedy evaluations (default: run.eval_every)")
    parser.add_argument("--headrace-run", type=pathlib.Path, action="append", default=[],
                        help="a finished headrace run of the same config to compare with "
                             "(repeatable)")
    args = parser.parse_args(argv)
    from headrace.config import ConfigError, load

    try:
        config = load(args.config, overrides=args.set)
    except (ConfigError, OSError) as error:
        parser.error(f"--config {args.config}: {error}")
    max_steps = 0
    if args.quick:  # a smoke run: a few iterations of a small batch, two evaluations
        args.seeds, max_steps, args.eval_every = 1, 4, 2
        config = dataclasses.replace(config, learner=dataclasses.replace(
            config.learner, groups_per_batch=4, minibatches=2))
    max_wall_s = args.max_wall_s or config.run.max_wall_s or 300.0
    eval_every = args.eval_every or config.run.eval_every or 20
    if args.seeds < 1 or eval_every < 1 or max_wall_s <= 0:
        parser.error("--seeds and --eval-every must be >= 1, --max-wall-s > 0")
    runs = [train(config, seed, max_wall_s, eval_every, max_steps) for seed in range(args.seeds)]
    reached = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
    result = {
        "runs": runs,
        "time_to_target_s": _median(reached),
        "reached": f"{len(reached)}/{len(runs)}",
        "settings": {"config": str(args.config), "overrides": args.set,
                     "target": config.run.eval_target, "eval_every": eval_every,
                     "max_wall_s": max_wall_s,
                     "episodes_per_step": config.learner.groups_per_batch
                     * config.actor.group_size,
                     "updates_per_step": config.learner.minibatches * config.learner.epochs},
    }
    if args.headrace_run:
        compared = [headrace_run(p) for p in args.headrace_run]
        times = [c["time_to_target_s"] for c in compared]
        result["headrace_time_to_target_s"] = times
        result["headrace_cpu_s_per_step"] = [c["cpu_s_per_step"] for c in compared]
        result["headrace_over_bare"] = _ratio(times, [r["time_to_target_s"] for r in runs])
        # What the time ratio is made of where both keep the machine's cores busy: the CPU a
        # learner step costs each, and the steps each needs to the target.
        result["cpu_per_step_over_bare"] = _ratio(result["headrace_cpu_s_per_step"],
                                                  [r["cpu_s_per_step"] for r in runs])
        result["headrace_steps_to_target"] = [c["steps_to_target"] for c in compared]
        result["steps_over_bare"] = _ratio(
            result["headrace_steps_to_target"],
            [r["steps"] if r["time_to_target_s"] is not None else None for r in runs])
    benchlib.emit(result, as_json=args.json, title="bare single-process JAX loop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
