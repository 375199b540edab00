#!/usr/bin/env bash
# Streaming generation with perf_analyzer (gRPC streams, decoupled model), from the project root,
# against `freetoken serve` on localhost. perf_analyzer ships in the Triton SDK image
# (nvcr.io/nvidia/tritonserver:<yy.mm>-py3-sdk). Each request sends one entry of the input data:
# text_input, stream=true, exclude_input_in_output=true, sampling_parameters with max_tokens 64.
set -euo pipefail
MODEL=${MODEL:-freetoken}
URL=${URL:-localhost:8001}
perf_analyzer -m "$MODEL" -u "$URL" -i grpc \
  --async --streaming \
  --input-data perf_analyzer_configs/input_data_stream.json \
  --concurrency-range 1:16:2 \
  --measurement-mode count_windows --measurement-request-count 64 \
  --profile-export-file profile_export_stream.json
# Non-streaming generation (one response per request; also over a gRPC stream, as the model is decoupled):
perf_analyzer -m "$MODEL" -u "$URL" -i grpc \
  --async --streaming \
  --input-data perf_analyzer_configs/input_data_generate.json \
  --concurrency-range 1:16:2 \
  --measurement-mode count_windows --measurement-request-count 64
