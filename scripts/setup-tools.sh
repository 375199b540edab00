#!/usr/bin/env bash
# Creates .tools-venv with the benchmark clients, apart from .venv (they pin their own numpy and
# pandas): perf_analyzer, the binary inside the tritonclient 2.51.0 wheel, and genai-perf on top.
# Idempotent. Then `source .tools-venv/bin/activate` puts both on PATH (see docs/benchmarks.md).
#
# perf_analyzer needs two shared libraries the wheel does not carry: libb64.so.0d (Debian's
# libb64-0d, installed here with apt-get when missing) and libcudart.so.12 (the nvidia-cuda-runtime-cu12
# wheel; loaded even for a CPU-only server). `perf_analyzer` in the venv is a wrapper that puts the
# latter on LD_LIBRARY_PATH before running the binary, so genai-perf finds a working one on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${FREETOKEN_TOOLS_VENV:-.tools-venv}
TRITONCLIENT=${FREETOKEN_TRITONCLIENT:-tritonclient[all]==2.51.0}
GENAI_PERF=${FREETOKEN_GENAI_PERF:-genai-perf==0.0.10}

if ! ldconfig -p | grep -q 'libb64\.so\.0d'; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq libb64-0d
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
stamp="$VENV/.freetoken-tools"
want="$TRITONCLIENT $GENAI_PERF"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "$TRITONCLIENT" nvidia-cuda-runtime-cu12 "$GENAI_PERF"
  # The wheel's binary lands in bin/; keep it beside the wrapper under another name.
  if ! grep -q freetoken-wrapper "$VENV/bin/perf_analyzer" 2>/dev/null; then
    mv "$VENV/bin/perf_analyzer" "$VENV/bin/perf_analyzer.bin"
  fi
  cudart=$("$VENV/bin/python" -c 'import nvidia.cuda_runtime, os; print(os.path.join(list(nvidia.cuda_runtime.__path__)[0], "lib"))')
  cat > "$VENV/bin/perf_analyzer" <<EOF
#!/bin/sh
# freetoken-wrapper: libcudart.so.12 from the nvidia-cuda-runtime-cu12 wheel (scripts/setup-tools.sh)
LD_LIBRARY_PATH="$cudart\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$(dirname "\$0")/perf_analyzer.bin" "\$@"
EOF
  chmod +x "$VENV/bin/perf_analyzer"
  echo "$want" > "$stamp"
fi
"$VENV/bin/perf_analyzer" --version >/dev/null 2>&1 || "$VENV/bin/perf_analyzer" --help >/dev/null
