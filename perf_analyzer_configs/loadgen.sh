#!/usr/bin/env bash
# FreeToken's own load client (no extra install): replays a perf_analyzer input-data file over gRPC
# streams and prints throughput, TTFT and inter-response latency as JSON. From the project root.
set -euo pipefail
URL=${URL:-localhost:8001}
python -m freetoken.bench.loadgen --url "$URL" --model "${MODEL:-freetoken}" \
  --input-data perf_analyzer_configs/input_data_stream.json --concurrency 8 --requests 64
