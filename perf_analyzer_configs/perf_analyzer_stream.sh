#!/usr/bin/env bash
# perf_analyzer against `freetoken serve` (gRPC streams, decoupled model), from the project root.
# perf_analyzer: `scripts/setup-tools.sh && source .tools-venv/bin/activate` (the tritonclient 2.51
# wheel's binary), or the Triton SDK image (nvcr.io/nvidia/tritonserver:<yy.mm>-py3-sdk).
# Each request sends one entry of the input data: text_input, stream, exclude_input_in_output and
# sampling_parameters with max_tokens 64 and ignore_eos, so every request decodes 64 tokens.
# CONCURRENCY is perf_analyzer's --concurrency-range (a sweep by default); REQUESTS the requests per
# measurement window; STABILITY the --stability-percentage (raise it on a busy CPU machine).
set -euo pipefail
MODEL=${MODEL:-freetoken}
URL=${URL:-localhost:8001}
CONCURRENCY=${CONCURRENCY:-1:16:2}
REQUESTS=${REQUESTS:-64}
STABILITY=${STABILITY:-10}
EXPORT=${EXPORT:-profile_export_stream.json}
perf_analyzer -m "$MODEL" -u "$URL" -i grpc \
  --async --streaming \
  --input-data perf_analyzer_configs/input_data_stream.json \
  --concurrency-range "$CONCURRENCY" \
  --measurement-mode count_windows --measurement-request-count "$REQUESTS" \
  --stability-percentage "$STABILITY" --max-trials 10 \
  --profile-export-file "$EXPORT"
if [ -n "${STREAM_ONLY:-}" ]; then exit 0; fi
# Non-streaming generation (one response per request; also over a gRPC stream, as the model is decoupled):
perf_analyzer -m "$MODEL" -u "$URL" -i grpc \
  --async --streaming \
  --input-data perf_analyzer_configs/input_data_generate.json \
  --concurrency-range "$CONCURRENCY" \
  --measurement-mode count_windows --measurement-request-count "$REQUESTS" \
  --stability-percentage "$STABILITY" --max-trials 10
