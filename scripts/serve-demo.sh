#!/usr/bin/env bash
# Sets up .venv (first run), then serves the embedded demo model (no downloads) with Triton
# Inference Server on this machine's CPU or GPU: HTTP :8000, gRPC :8001, metrics :8002.
# Extra arguments go to `freetoken serve` (e.g. --http-port 9000, --model /path/to/checkpoint).
# Try it:  curl -X POST localhost:8000/v2/models/freetoken/generate \
#            -d '{"text_input": "The quick brown fox", "sampling_parameters": "{\"max_tokens\": 16}"}'
# Ctrl-C (or SIGTERM) stops the server and every process it started.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/freetoken serve "$@"
