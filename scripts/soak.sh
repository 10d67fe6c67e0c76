#!/usr/bin/env bash
# Soak (issue 10): a router over one prefill and two decode nodes under mixed load for
# SOAK_MINUTES minutes (default 30): canaries from three tenants, over-length prompts (400),
# clients vanishing mid-stream, a decode node killed (SIGKILL) and restarted every
# SOAK_RESTART_SECONDS. Samples resident memory and page accounting every
# SOAK_SAMPLE_SECONDS (default 60), prints a table, and exits non-zero on a canary leak, a
# wrong status, pages not back to idle, or memory growth beyond the bound in
# tests/python/soak.py. Samples are kept under SOAK_OUT (default target/soak).
# Usage: SOAK_MINUTES=3 scripts/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/fetch-model.sh >/dev/null
python=$(./scripts/python-env.sh)
if [ ! -x target/debug/kvwarden ]; then
  cargo build -p kvwarden
fi
minutes=${SOAK_MINUTES:-30}
# Bounded: the run itself, plus start, drain and quiescence.
limit=$(awk -v m="$minutes" 'BEGIN { printf "%d", m * 60 + 600 }')
timeout "$limit" "$python" tests/python/soak.py
