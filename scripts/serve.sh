#!/usr/bin/env bash
# Serves the default model (fetching it first if needed) on http://127.0.0.1:8000.
# Extra arguments go to `kvwarden serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/fetch-model.sh
exec cargo run --release -p kvwarden -- serve "$@"
