#!/usr/bin/env bash
# Compiles every Triton kernel for the GPU host (sm_90, Triton 3.6: the lent H200's versions) on
# this CPU, launching none (tests/kernels/compile_only.py). Catches what only compiled Triton
# rejects; the interpreter tests check the arithmetic. Set TRITON_VERSION / ARCH to check others.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
version=${TRITON_VERSION:-3.6.0}
site=.venv/triton-$version
if [ ! -d "$site/triton" ]; then
  .venv/bin/python -m pip install -q --no-deps --target "$site" "triton==$version"
fi
PYTHONPATH="$site" FREETOKEN_COMPILE_CHECK=${ARCH:-90} exec .venv/bin/python -m pytest tests/kernels -q -p no:cacheprovider "$@"
