#!/usr/bin/env bash
# The fault suite's short form (issue 10): a router over one prefill and two decode nodes
# on loopback, canary traffic from two tenants throughout, a hung decode node mid-stream, a
# hung prefill node mid-prefill, a killed decode node and a killed router, each restarted on
# its address; it checks statuses, zero canary leaks, page accounting back to idle on every
# node, and that the restarted node and router serve again. Bounded: the test's own
# liveness bounds, and `timeout`.
# Usage: scripts/faults.sh   (runs in scripts/test.sh too; prints its figures with -s)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/fetch-model.sh >/dev/null
python=$(./scripts/python-env.sh)
if [ ! -x target/debug/kvwarden ]; then
  cargo build -p kvwarden
fi
timeout 600 "$python" -m pytest tests/python/test_faults.py -q -s "$@"
