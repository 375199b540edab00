#!/usr/bin/env bash
# Creates .venv with FreeToken and everything its server and tests need. Idempotent.
# On a machine without a GPU it takes PyTorch's CPU build (torch 2.13.0); set FREETOKEN_TORCH to
# pick another torch requirement (e.g. FREETOKEN_TORCH="torch>=2.11" for a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if [ -z "${FREETOKEN_TORCH:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    FREETOKEN_TORCH="torch>=2.11"
  else
    FREETOKEN_TORCH="torch==2.13.0"
  fi
fi
stamp=.venv/.freetoken-setup
want="$FREETOKEN_TORCH $(sha1sum pyproject.toml | cut -c1-12)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "$FREETOKEN_TORCH" -e ".[serve,test,bench]"
  echo "$want" > "$stamp"
fi
