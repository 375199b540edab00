#!/usr/bin/env bash
# Creates .venv with FreeToken and everything its server and tests need. Idempotent.
#
# torch: with a GPU (nvidia-smi sees one) a CUDA build from PyPI ("torch>=2.11"); without one,
# PyTorch's CPU build of torch 2.13.0 from PyTorch's CPU wheel index, which spares the CUDA build
# and its NVIDIA libraries (several GB) that `torch==2.13.0` resolves to on PyPI. Override with
# FREETOKEN_TORCH (a pip requirement, e.g. "torch>=2.11" for a CUDA build) and FREETOKEN_TORCH_INDEX
# (an extra index for it; empty for none). A machine whose pip already offers a CPU wheel (a local
# wheel folder) or cannot reach the CPU index installs from what pip has.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CPU_INDEX=https://download.pytorch.org/whl/cpu
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if [ -z "${FREETOKEN_TORCH:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    FREETOKEN_TORCH="torch>=2.11"
    FREETOKEN_TORCH_INDEX=${FREETOKEN_TORCH_INDEX-}
  else
    FREETOKEN_TORCH="torch==2.13.0"
    FREETOKEN_TORCH_INDEX=${FREETOKEN_TORCH_INDEX-$CPU_INDEX}
  fi
fi
index=${FREETOKEN_TORCH_INDEX:-}
if [ -n "$index" ] && ! .venv/bin/python -c "import socket, sys, urllib.parse; socket.getaddrinfo(urllib.parse.urlsplit(sys.argv[1]).hostname, 443)" "$index" 2>/dev/null; then
  echo "setup.sh: $index is unreachable; taking torch from pip's configured sources" >&2
  index=""
fi
stamp=.venv/.freetoken-setup
want="$FREETOKEN_TORCH $index $(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"  # a changed extra reinstalls
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first, alone with its index, so that nothing else is resolved from that index
  .venv/bin/python -m pip install -q ${index:+--extra-index-url "$index"} "$FREETOKEN_TORCH"
  .venv/bin/python -m pip install -q "$FREETOKEN_TORCH" -e ".[serve,test,bench]"
  echo "$want" > "$stamp"
fi
