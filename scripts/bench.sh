#!/usr/bin/env bash
# `freetoken bench` from this checkout on a GPU machine with torch + Triton (the lent H200), no build:
# FreeToken is copied into a site folder as scripts/gpu_check.sh does (scripts/gpu_site.sh), and a
# transformers wheel in .whl/ (git-ignored) is installed there first when present. Arguments go to
# `freetoken bench`, e.g.
#   OUT=/tmp/out bash scripts/bench.sh --preset qwen3.6-35b-a3b --json /tmp/out/bench.json
# The log is written to $OUT/bench.log (default /tmp/freetoken-bench).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/freetoken-bench}
mkdir -p "$OUT"
GPU_SITE_LOG="$OUT/bench.log"
source scripts/gpu_site.sh
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$OUT/bench.log"
python3 -m freetoken.cli bench "$@" 2>&1 | tee -a "$OUT/bench.log"
exit "${PIPESTATUS[0]}"
