#!/usr/bin/env bash
# The kernels at the model sizes people serve (issue 20): synthetic files of Llama 3.2 1B's
# and Llama 3.2 3B's shapes (random weights, written by `kvwarden synth-model` as Q8_0 and
# requantized by llama.cpp's llama-quantize to its Q4_K_M preset, so the mix is the one real
# files have: Q4_K with Q6_K for ffn_down, V and the output), kept in models/ once made;
# then bench/quants.sh on them (pp512 and tg128 against llama-bench, by default and with its
# plain kernels only) and the machine's read bandwidth (`cargo bench -p model --bench
# bandwidth`) with each decode's fraction of it: a decode step reads every weight once, and
# these files' embedding is the output projection, so a token reads about the whole file.
# SIZES="1b 3b" (default both), THREADS as quants.sh. Timings are never pass/fail tests; run
# on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q --release -p kvwarden
quantize=$(./bench/build-llama-server.sh llama-quantize)
files=""
for size in ${SIZES:-1b 3b}; do
  case $size in
    1b) shape=(--layers 16 --dim 2048 --heads 32 --kv-heads 8 --ffn 8192) ;;
    3b) shape=(--layers 28 --dim 3072 --heads 24 --kv-heads 8 --ffn 8192) ;;
    *) echo "model-size.sh: unknown size $size (1b, 3b)" >&2; exit 2 ;;
  esac
  file=synth-llama3-$size.Q4_K_M.gguf
  if [ ! -f "models/$file" ]; then
    tmp=$(mktemp -d)
    target/release/kvwarden synth-model --arch llama3 "${shape[@]}" --vocab 128256 \
      --weight-type q8_0 -o "$tmp/q8_0.gguf"
    "$quantize" --allow-requantize "$tmp/q8_0.gguf" "models/$file.part" Q4_K_M "$(nproc)" >/dev/null 2>&1
    mv "models/$file.part" "models/$file"
    rm -rf "$tmp"
  fi
  files="$files $file"
done
out=$(FILES="$files" ./bench/quants.sh)
echo "$out"
bandwidth=$(cargo bench -q -p model --bench bandwidth 2>/dev/null | tail -1)
echo "$bandwidth"
python3 - "$bandwidth" "$out" $files <<'PY'
import os, re, sys
gbs = float(re.search(r"read_gb_s=([0-9.]+)", sys.argv[1]).group(1))
out = sys.argv[2]
for f in sys.argv[3:]:
    size = os.path.getsize(os.path.join("models", f)) / 1e9
    m = re.search(re.escape(f[:-5]) + r": kvwarden .*?(tg\d+)=([0-9.]+)", out)
    if m:
        print(f"{f}: decode reads ~{size:.2f} GB a token: {float(m.group(2)) * size:.1f} GB/s, "
              f"{100 * float(m.group(2)) * size / gbs:.0f}% of the measured {gbs:.1f} GB/s")
PY
