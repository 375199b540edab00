#!/usr/bin/env bash
# genai-perf with its vLLM-backend request format, which FreeToken speaks unchanged (text_input,
# stream, sampling_parameters, exclude_input_in_output). Run from the project root; TOKENIZER is the
# served model's directory (for the demo model: `freetoken demo-model` prints it).
set -euo pipefail
MODEL=${MODEL:-freetoken}
URL=${URL:-localhost:8001}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the served model directory}
# genai-perf >= 0.0.10 (older releases spell "--endpoint-type kserve" as "--service-kind triton").
genai-perf profile -m "$MODEL" --backend vllm --endpoint-type kserve -u "$URL" \
  --tokenizer "$TOKENIZER" \
  --streaming \
  --synthetic-input-tokens-mean 128 --synthetic-input-tokens-stddev 0 \
  --output-tokens-mean 64 --output-tokens-stddev 0 --output-tokens-mean-deterministic \
  --extra-inputs ignore_eos:true \
  --concurrency 8 --request-count 64 --warmup-request-count 4
