#!/usr/bin/env bash
# The README's main job (examples/guess_number.yaml) with its learner on this machine's
# accelerator (GPU or TPU) and its actor processes on the CPUs, for each actor count in ACTORS,
# then the bare single-process loop (`headrace bench bare`) on the same accelerator. Needs JAX for
# the accelerator and headrace's dependencies importable (the package need not be installed: run
# from the repository root) and a redis-server on PATH. The buffer's Redis listens on a unix
# socket (`buffer.transport=unix`), so no TCP port is needed.
#
#   scripts/accelerator_example.sh OUT_DIR
#
# OUT_DIR gets machine.txt (JAX's devices, the CPUs), aN.json for N actor processes (the run's
# `--json` summary, the median of every figure of its metrics.jsonl from learner step 30 on, and
# the evaluation curve), bare.json (`headrace bench bare --json`) and log.txt (each command's
# last lines). ACTORS (default "1 4"), RUN_S (each run's wall-clock limit, default 200), SEEDS (the
# bare loop's, default 1) and SET (more --set arguments for every run) change what runs.
set -uo pipefail
out=${1:?usage: scripts/accelerator_example.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
status=0
"$python" - >"$out/machine.txt" 2>&1 <<'EOF' || status=$?
import os, platform, jax
print("jax", jax.__version__, "devices", jax.devices(), "backend", jax.default_backend())
print("cpus", os.cpu_count(), "usable", len(os.sched_getaffinity(0)), "libc", platform.libc_ver())
EOF
cat "$out/machine.txt"
for actors in ${ACTORS:-1 4}; do
  run="$out/runs/a$actors"
  rm -rf "$run"
  # shellcheck disable=SC2086
  timeout $(( ${RUN_S:-200} + 120 )) "$python" -m headrace.cli train examples/guess_number.yaml \
    --set buffer.transport=unix --set actor.num_actors="$actors" --set run.dir="$run" \
    --set run.max_wall_s="${RUN_S:-200}" ${SET:-} --json >"$out/a$actors.summary" 2>"$out/a$actors.log" \
    || status=$?
  { echo "--- $actors actor(s)"; tail -n 5 "$out/a$actors.log"; } >>"$out/log.txt"
  "$python" - "$run" "$out/a$actors.summary" >"$out/a$actors.json" <<'EOF' || status=$?
import json, pathlib, statistics, sys
run, summary = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
steady = [r for r in records if r.get("learner/step", 0) >= 30] or records
keys = sorted({k for r in steady for k, v in r.items() if isinstance(v, (int, float))})
print(json.dumps({
    "summary": json.loads(summary.read_text() or "null"),
    "steady_median": {k: statistics.median(r[k] for r in steady if k in r)
                      for k in keys if any(k in r for r in steady)},
    "eval_curve": [[r["learner/step"], round(r["time"] - records[0]["time"], 1), r["eval/success_rate"]]
                   for r in records if "eval/success_rate" in r]}))
EOF
  head -c 1500 "$out/a$actors.json"; echo
done
timeout 900 "$python" -m headrace.cli bench bare --seeds "${SEEDS:-1}" --json >"$out/bare.json" \
  2>"$out/bare.log" || status=$?
{ echo "--- bare"; tail -n 5 "$out/bare.log"; } >>"$out/log.txt"
cat "$out/bare.json"
exit "$status"
