#!/usr/bin/env bash
# Sets up .venv (first run), builds the embedded demo model (no downloads) and generates with it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/freetoken generate --prompt "${1:-The quick brown fox}" --max-tokens 32 "${@:2}"
