#!/usr/bin/env bash
# aiperf (pip install aiperf) through its template endpoint on Triton's generate extension over HTTP:
# the payload is the vLLM-backend request, text_output is the generated text (SSE when streaming).
# Run from the project root; TOKENIZER is the served model's directory (aiperf 0.13 loads a local
# directory only with HF_HUB_OFFLINE unset). Seen completing against `freetoken serve` on the demo
# model with aiperf 0.13.0 (64/64 requests). aiperf counts output tokens by re-tokenizing the text.
set -euo pipefail
MODEL=${MODEL:-freetoken}
HTTP=${HTTP:-http://localhost:8000}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the served model directory}
aiperf profile -m "$MODEL" --tokenizer "$TOKENIZER" \
  --url "$HTTP/v2/models/$MODEL/generate_stream" \
  --endpoint-type template --streaming \
  --extra-inputs payload_template:perf_analyzer_configs/aiperf_payload.jinja \
  --extra-inputs response_field:text_output \
  --synthetic-input-tokens-mean 128 --synthetic-input-tokens-stddev 0 \
  --output-tokens-mean 64 --output-tokens-stddev 0 \
  --concurrency 8 --request-count 64
