#!/usr/bin/env bash
# What the KV ownership checks cost: the decode-step benchmark built twice, with the checks
# and with the benchmark-only unchecked baseline, run back to back on the same machine.
# Also prints the cost of scrubbing a page. Run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/fetch-model.sh
export BENCH_STEPS=${BENCH_STEPS:-96}
checked=$(cargo bench -q -p model --bench decode_step 2>/dev/null | tee /dev/stderr)
unchecked=$(CARGO_TARGET_DIR=target/bench-unchecked cargo bench -q -p model --bench decode_step --features kv/bench-unchecked-baseline 2>/dev/null | tee /dev/stderr)
python3 - "$checked" "$unchecked" <<'PY'
import re, sys
def grab(text, key):
    return float(re.search(key + r"=([0-9.]+)", text).group(1))
c, u = sys.argv[1], sys.argv[2]
for key in ("single", "batch8"):
    a, b = grab(c, key), grab(u, key)
    print(f"decode step {key}: checked {a:.3f} ms, unchecked {b:.3f} ms, checks cost {100 * (a - b) / b:+.2f}%")
rc, ru, step = grab(c, "reads_per_batch8_step_ms"), grab(u, "reads_per_batch8_step_ms"), grab(c, "batch8")
print(f"KV reads of one batch-8 decode step: checked {rc:.5f} ms, unchecked {ru:.5f} ms; the checks cost {100 * (rc - ru) / step:.4f}% of the step")
page = grab(c, "scrub_zero_ms_per_page")
step = grab(c, "single")
print(f"scrub (zero) of one 16-token page: {page:.4f} ms = {100 * page / (16 * step):.3f}% of the 16 decode steps that fill it")
PY
