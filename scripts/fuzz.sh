#!/usr/bin/env bash
# Runs every cargo-fuzz target (fuzz/fuzz_targets/) for a fixed time and prints the
# executions of each. Usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
# (default 20 s, every target). `.ci/run` (through scripts/test.sh) runs the short form; run
# it with, say, 1800 for a long run. Corpora grow in fuzz/corpus/TARGET (git-ignored) from
# the committed seeds in fuzz/seeds/TARGET; a crash stops the run with its input saved in
# fuzz/artifacts/TARGET/ and a non-zero exit. Reproduce one with
#   cargo +nightly fuzz run --fuzz-dir fuzz --target-dir target/fuzz TARGET fuzz/artifacts/TARGET/crash-...
# Needs the nightly toolchain (libFuzzer's instrumentation) and cargo-fuzz, which this
# installs from crates.io if it is missing. The build lives in target/fuzz so that the
# CI clone reuses its dependencies like the rest of target/.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-20}
shift || true
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  echo "fuzz.sh: the nightly toolchain is missing (rustup toolchain install nightly)" >&2
  exit 1
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi

fuzz=(cargo +nightly fuzz)
common=(--fuzz-dir fuzz --target-dir target/fuzz)
if [ "$#" -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <("${fuzz[@]}" list --fuzz-dir fuzz)
fi
# The chat_prompt target reads the default model's vocabulary.
./scripts/fetch-model.sh >/dev/null

# `cargo fuzz build` builds one target or all of them.
if [ "$#" -eq 1 ]; then
  "${fuzz[@]}" build "${common[@]}" "$1"
else
  "${fuzz[@]}" build "${common[@]}"
fi

summary=()
total=0
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t"
  log=$(mktemp)
  echo "fuzz.sh: $t for ${seconds}s" >&2
  # The first corpus directory receives new inputs; the committed seeds are only read.
  if ! LSAN_OPTIONS="suppressions=$PWD/fuzz/lsan.supp${LSAN_OPTIONS:+:$LSAN_OPTIONS}" "${fuzz[@]}" run "${common[@]}" "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
    -max_total_time="$seconds" -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
    >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    echo "fuzz.sh: $t FAILED; the input is in fuzz/artifacts/$t/" >&2
    rm -f "$log"
    exit 1
  fi
  runs=$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$log" | tail -n 1)
  cov=$(sed -n 's/^#[0-9]*[[:space:]]*DONE[[:space:]]*cov: \([0-9]*\).*/\1/p' "$log" | tail -n 1)
  rm -f "$log"
  if [ -z "$runs" ]; then
    echo "fuzz.sh: $t printed no execution count" >&2
    exit 1
  fi
  total=$((total + runs))
  summary+=("$(printf '%-14s %12s executions  cov %s' "$t" "$runs" "${cov:-?}")")
done
printf 'fuzz.sh: %s\n' "${summary[@]}"
echo "fuzz.sh: $total executions in total, no crash" >&2
