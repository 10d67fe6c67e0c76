#!/usr/bin/env bash
# Line coverage of the code each fuzz target reaches, measured by replaying its corpus
# (fuzz/corpus/TARGET, grown by scripts/fuzz.sh, plus the committed seeds) through a
# coverage-instrumented build. Prints, per target, the covered share of the lines of the
# source files the target exists to exercise. Usage:
#   scripts/fuzz.sh 600 && scripts/fuzz-coverage.sh [TARGET...]
# Needs the nightly toolchain with llvm-tools (rustup component add llvm-tools-preview
# --toolchain nightly; this script adds it if missing). The build lives in target/fuzz-cov.
set -euo pipefail
cd "$(dirname "$0")/.."

fuzz=(cargo +nightly fuzz)
common=(--fuzz-dir fuzz --target-dir target/fuzz-cov)
sysroot=$(rustup run nightly rustc --print sysroot)
llvm_cov="$sysroot/lib/rustlib/x86_64-unknown-linux-gnu/bin/llvm-cov"
if [ ! -x "$llvm_cov" ]; then
  rustup component add llvm-tools-preview --toolchain nightly >&2
fi
if [ "$#" -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <("${fuzz[@]}" list --fuzz-dir fuzz)
fi

# The files each target is there to exercise: its coverage is reported over these.
sources_of() {
  case "$1" in
    gguf_parse) echo "crates/gguf/src/reader.rs crates/gguf/src/types.rs" ;;
    model_load) echo "crates/gguf/src/reader.rs crates/model/src/config/mod.rs crates/model/src/weights.rs crates/model/src/forward/load.rs" ;;
    lora_load) echo "crates/model/src/lora/load.rs" ;;
    chat_prompt) echo "crates/server/src/chat_prompt.rs crates/tokenizer/src/lib.rs crates/tokenizer/src/pretokenize/*.rs" ;;
    http_body) echo "crates/server/src/request.rs crates/server/src/body.rs" ;;
    node_messages) echo "crates/transfer/src/wire.rs" ;;
    handoff) echo "crates/engine/src/handoff.rs crates/kv/src/transfer.rs" ;;
    *) echo "" ;;
  esac
}

./scripts/fetch-model.sh >/dev/null
for t in "${targets[@]}"; do
  corpus=$(mktemp -d)
  cp -r "fuzz/seeds/$t/." "$corpus/" 2>/dev/null || true
  if [ -d "fuzz/corpus/$t" ]; then
    cp -r "fuzz/corpus/$t/." "$corpus/"
  fi
  inputs=$(find "$corpus" -type f | wc -l)
  echo "fuzz-coverage.sh: $t: replaying $inputs inputs" >&2
  "${fuzz[@]}" coverage "${common[@]}" "$t" "$corpus" >/dev/null 2>&1
  rm -rf "$corpus"
  bin="target/fuzz-cov/x86_64-unknown-linux-gnu/release/$t"
  profile="fuzz/coverage/$t/coverage.profdata"
  files=$(sources_of "$t")
  if [ -z "$files" ]; then
    echo "fuzz-coverage.sh: no source list for $t; add it to sources_of" >&2
    exit 1
  fi
  # shellcheck disable=SC2086
  "$llvm_cov" report "$bin" -instr-profile="$profile" $files |
    awk -v t="$t" -v n="$inputs" '
      /^TOTAL/ { printf "%-14s %6d inputs  lines %s covered of %s (%s)\n", t, n, $8 - $9, $8, $10 }
      $1 ~ /\.rs$/ { printf "    %-46s lines %5s  missed %5s  %s\n", $1, $8, $9, $10 }'
done
