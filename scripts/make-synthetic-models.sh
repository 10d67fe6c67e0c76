#!/usr/bin/env bash
# Writes the synthetic random-weight models of the architectures no small real file exists
# for (qwen2, qwen3, Llama 3), into models/ (git-ignored), with `kvwarden synth-model`: the
# files crates/model/tests/llama_references.rs compares with llama.cpp's recorded output.
# Deterministic (fixed seeds), so the bytes are the recorded ones. Uses KVWARDEN, or
# target/debug/kvwarden (built here first, so it is the checkout's). Idempotent.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${KVWARDEN:-}" ]; then
  (cd "$root" && cargo build -q -p kvwarden)
fi
bin=${KVWARDEN:-$root/target/debug/kvwarden}
mkdir -p "$root/models"
# name arch weight-type: K-quant layer weights (widths are multiples of 256) so the
# k-quant kernels are compared too.
while read -r name arch ty; do
  out="$root/models/$name.gguf"
  [ -f "$out" ] && continue
  "$bin" synth-model --arch "$arch" --weight-type "$ty" --layers 2 --dim 256 --heads 4 \
    --kv-heads 2 --ffn 512 --vocab 512 --context 2048 --seed 7 -o "$out.tmp"
  mv "$out.tmp" "$out"
done <<'LIST'
synth-qwen2-q4_k qwen2 q4_k
synth-qwen3-q6_k qwen3 q6_k
synth-llama3-q5_k llama3 q5_k
LIST
