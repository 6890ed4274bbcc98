#!/usr/bin/env bash
# The learner's throughput on one GPU: a Qwen2.5-0.5B-shaped model (random weights,
# examples/qwen2.5_0.5b_config.json), GRPO steps of 16 groups of 8 episodes of 1,000 tokens
# (232 prompt + 768 answer) packed four to a 4,096-token row, two rows per microbatch;
# bfloat16 with remat off and on, then float32 with remat on. Needs a CUDA JAX, flax, optax,
# msgpack, redis-py (the client library only), PyYAML and rich; the package need not be installed
# (run from the repository root). About 6 minutes on an H200, compiles included.
#
#   scripts/gpu_learner.sh OUT_DIR [MODEL_CONFIG.json]
#
# OUT_DIR gets gpu.txt (the device), bf16.json / fp32.json (`headrace bench learner --json`) and
# their logs (each variant's row is printed there as soon as it is measured). STEP_GROUPS overrides
# the groups per step (16), PEAK the peak TFLOP/s for mfu (989: H100/H200 dense bfloat16).
set -uo pipefail
out=${1:?usage: scripts/gpu_learner.sh OUT_DIR [MODEL_CONFIG.json]}
model=${2:-examples/qwen2.5_0.5b_config.json}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
python=${PYTHON:-python3}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  "$python" -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
} 2>&1 | tee "$out/gpu.txt"
bench=(-m headrace.cli bench learner --model-config "$model" --peak-tflops "${PEAK:-989}"
       --prompt-len 232 --answer-len 768 --steps 3 --json
       --set 'shapes.buckets=[4096]' --set learner.token_budget=8192
       --set "learner.groups_per_batch=${STEP_GROUPS:-16}" --set actor.group_size=8
       --set actor.envs_per_actor=64 --set actor.max_batch=64 --set sampling.max_new_tokens=128)
status=0
timeout "${BF16_S:-330}" "$python" "${bench[@]}" --dtypes bfloat16 --remats none,block \
  >"$out/bf16.json" 2>"$out/bf16.log" || status=$?
tail -n 3 "$out/bf16.log"
timeout "${FP32_S:-150}" "$python" "${bench[@]}" --dtypes float32 --remats block \
  >"$out/fp32.json" 2>"$out/fp32.log" || status=$?
tail -n 3 "$out/fp32.log"
exit "$status"
