#!/usr/bin/env bash
# genai-perf with its vLLM-backend request format, which FreeToken speaks unchanged (text_input,
# stream, sampling_parameters, exclude_input_in_output). Run from the project root after
# `scripts/setup-tools.sh && source .tools-venv/bin/activate` (genai-perf 0.0.10 over the tritonclient
# 2.51 wheel's perf_analyzer). TOKENIZER is the served model's directory (for the demo model:
# `freetoken demo-model` prints it).
#
# No EOS stop: --output-tokens-mean-deterministic sends min_tokens = max_tokens in
# sampling_parameters, so every request decodes exactly OUTPUT_TOKENS tokens. (`--extra-inputs
# ignore_eos:true` would not do it: genai-perf sends extra inputs as top-level tensors, which neither
# FreeToken nor the vLLM backend has.) No --warmup-request-count: perf_analyzer 2.51 hangs on it.
set -euo pipefail
MODEL=${MODEL:-freetoken}
URL=${URL:-localhost:8001}
METRICS_URL=${METRICS_URL:-http://localhost:8002/metrics}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the served model directory}
CONCURRENCY=${CONCURRENCY:-8}
REQUESTS=${REQUESTS:-64}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-64}
# genai-perf >= 0.0.10 (older releases spell "--endpoint-type kserve" as "--service-kind triton").
genai-perf profile -m "$MODEL" --backend vllm --endpoint-type kserve -u "$URL" \
  --server-metrics-url "$METRICS_URL" \
  --tokenizer "$TOKENIZER" \
  --streaming \
  --synthetic-input-tokens-mean 128 --synthetic-input-tokens-stddev 0 \
  --output-tokens-mean "$OUTPUT_TOKENS" --output-tokens-stddev 0 --output-tokens-mean-deterministic \
  --concurrency "$CONCURRENCY" --request-count "$REQUESTS" \
  ${ARTIFACTS:+--artifact-dir "$ARTIFACTS"}
