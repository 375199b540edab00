#!/usr/bin/env bash
# Sets up .venv (first run) and runs the default test suite (no GPU, no slow tests), then compiles
# every Triton kernel for the GPU host's sm_90 / Triton 3.6 (scripts/compile_check.sh).
# Extra arguments go to pytest alone, e.g. scripts/test.sh -m gpu, or scripts/test.sh tests/test_cli.py.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
.venv/bin/python -m pytest
scripts/compile_check.sh
