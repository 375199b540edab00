#!/usr/bin/env bash
# Sets up .venv (first run) and runs the default test suite (no GPU, no slow tests).
# Extra arguments go to pytest, e.g. scripts/test.sh -m gpu, or scripts/test.sh tests/test_engine_parity.py.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
