#!/usr/bin/env bash
# Makes the real K-quant test files: the default model (scripts/fetch-model.sh) requantized by
# llama.cpp's own `llama-quantize` (built from the llama-cpp-python==0.3.36 sdist by
# bench/build-llama-server.sh, cached in .peer/) into models/ (git-ignored), each checked
# against the sha256 recorded below. llama-quantize's output does not depend on its thread
# count or the run (checked when these were recorded), so a mismatch means a different
# llama.cpp, or a compiler/CPU whose float arithmetic differs (the peer is built with
# GGML_NATIVE): the references in tests/data/llama-refs/ were recorded on these exact bytes.
#
# The model's rows are 576 wide, not a multiple of 256, so llama-quantize falls back for
# most tensors (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0); the k-quants
# land in ffn_down (1536 wide). Q2_K-pure (`--pure`) is the only file with Q2_K tensors.
#
# Idempotent: files already present with the right sha256 are kept. Prints nothing on success
# but what it made. Building llama-quantize alone takes a few minutes on 2 cores.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
base_name=SmolLM2-135M-Instruct
base="$root/models/$base_name.Q4_1.gguf"

# name  llama-quantize type  extra flags (- for none)  sha256 of the output
variants=(
  "Q8_0     Q8_0    -       7b46609d11703c058397e5cfe4cc6e4b2508cb1eb4c80ddc472a5d421fbdb508"
  "Q6_K     Q6_K    -       a969ae2086dd4945a7c61594bf72b2bcc3b7df8571c92aed8f213918673a7f80"
  "Q5_K_M   Q5_K_M  -       8170c7ef444692b3b2fe63459c326def0358807ef9be6e3cb020efb86a71015e"
  "Q4_K_M   Q4_K_M  -       dc0f3a02e821146247a0af6895adf9872124f368682cb110cb9ed09ff2a9f9f1"
  "Q3_K_M   Q3_K_M  -       01045a8fee6c962e4f7b0f80dccf937503738f61f987c305378fd3f527eac9d4"
  "Q2_K     Q2_K    -       1733ab14bc423774519aa464e0d74e190617e877c9d0aa07a698b500d1788895"
  "Q2_K-pure Q2_K   --pure  dc183fb648339d62e10b7f7a2cbafa8a502ff5e6c8c284b821c1d890426777a2"
)

ok() { [ -f "$1" ] && echo "$2  $1" | sha256sum --check --status; }

missing=()
for v in "${variants[@]}"; do
  read -r name _ _ sha <<<"$v"
  ok "$root/models/$base_name.$name.gguf" "$sha" || missing+=("$v")
done
[ ${#missing[@]} -eq 0 ] && exit 0

"$root/scripts/fetch-model.sh"
quantize=$("$root/bench/build-llama-server.sh" llama-quantize)
tmp=$(mktemp -d "$root/models/.quant.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
for v in "${missing[@]}"; do
  read -r name ty flags sha <<<"$v"
  [ "$flags" = "-" ] && flags=""
  out="$tmp/$base_name.$name.gguf"
  # shellcheck disable=SC2086 # flags is a list of words
  if ! nice -n 10 "$quantize" --allow-requantize $flags "$base" "$out" "$ty" "$(nproc)" >"$tmp/log" 2>&1; then
    tail -20 "$tmp/log" >&2
    echo "fetch-quant-models: llama-quantize failed for $name" >&2
    exit 1
  fi
  if ! ok "$out" "$sha"; then
    echo "fetch-quant-models: $name: sha256 $(sha256sum "$out" | cut -d' ' -f1), expected $sha." >&2
    echo "  llama-quantize ($quantize) wrote different bytes than when the references were" >&2
    echo "  recorded; rebuild it from the pinned sdist (rm -rf .peer) or re-record the" >&2
    echo "  references (scripts/record-llama-references.py) and update this script." >&2
    exit 1
  fi
  mv "$out" "$root/models/"
  echo "fetch-quant-models: stored models/$base_name.$name.gguf" >&2
done
