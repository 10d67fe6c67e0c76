#!/usr/bin/env bash
# kvwarden against llama.cpp's own llama-bench on the K-quant files (Q4_K_M and Q6_K, made by
# scripts/fetch-quant-models.sh), same files, same run, same thread count: pp512 and tg128
# in tokens per second, and their ratios; also against llama.cpp with its plain kernels only
# (`--repack 0`, `GGML_CPU_TILED_MM=0`), its reference arithmetic. llama-bench is
# built from the same sdist as the references (bench/build-llama-server.sh llama-bench,
# cached in .peer/), flash attention on as in the references, its other settings its
# defaults (so its weight repacking and tiled matmul on). Run on an otherwise idle machine;
# timings are never pass/fail tests. kvwarden's figures are the median of RUNS runs (default
# 5; llama-bench averages its 5 repetitions). QUANTS="Q4_K_M Q6_K" and THREADS override the defaults;
# FILES="a.gguf b.gguf" (names under models/) takes other files instead (bench/model-size.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${THREADS:-$(nproc)}
np=${BENCH_PP:-512}
ng=${BENCH_TG:-128}
if [ -z "${FILES:-}" ]; then
  ./scripts/fetch-quant-models.sh
  FILES=""
  for q in ${QUANTS:-Q4_K_M Q6_K}; do FILES="$FILES SmolLM2-135M-Instruct.$q.gguf"; done
fi
llama_bench=$(./bench/build-llama-server.sh llama-bench)
for file in $FILES; do
  q=${file%.gguf}
  # RUNS runs (default 5, as llama-bench's repetitions), their median taken below: on a VM
  # one decode run can land 25% off its neighbours.
  ours=""
  for _ in $(seq "${RUNS:-5}"); do
    ours="$ours $(BENCH_MODEL=$file BENCH_PP=$np BENCH_TG=$ng RAYON_NUM_THREADS=$threads \
      cargo bench -q -p model --bench throughput 2>/dev/null | tail -1)"
  done
  # Where llama.cpp's default path cannot run (its AMX kernels die with SIGILL on some Xeon
  # VMs), it runs without repacking (`--repack 0`, its tiled matmul still on), as
  # bench/serve.py does, and the output says so.
  status=0
  theirs=$("$llama_bench" -m "models/$file" -p "$np" -n "$ng" -t "$threads" -fa 1 -o json \
    2>/dev/null) || status=$?
  if [ "$status" -ne 0 ]; then
    [ "$status" -gt 128 ] && why="died by signal $((status - 128))" || why="failed ($status)"
    echo "$q: llama.cpp's default path $why here: 'llama.cpp' below is llama.cpp --repack 0"
    theirs=$("$llama_bench" -m "models/$file" -p "$np" -n "$ng" -t "$threads" -fa 1 \
      --repack 0 -o json 2>/dev/null)
  fi
  # llama.cpp again with its plain kernels only (no weight repacking, no tiled K-quant
  # matmul): the reference arithmetic (scripts/record-llama-references.py).
  plain=$(GGML_CPU_TILED_MM=0 "$llama_bench" -m "models/$file" -p "$np" -n "$ng" -t "$threads" \
    -fa 1 --repack 0 -o json 2>/dev/null)
  python3 - "$q" "$ours" "$theirs" "$plain" <<'PY'
import json, re, statistics, sys
q, runs = sys.argv[1], {}
for k, v in re.findall(r"(pp\d+|tg\d+)=([0-9.]+)", sys.argv[2]):
    runs.setdefault(k, []).append(float(v))
ours = {k: statistics.median(v) for k, v in runs.items()}

def rates(runs):
    return {(f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"): r["avg_ts"]
            for r in json.loads(runs)}

peer, plain = rates(sys.argv[3]), rates(sys.argv[4])
line = lambda d: " ".join(f"{k}={v:.1f}" for k, v in d.items())
print(f"{q}: kvwarden {line(ours)} | llama.cpp {line(peer)} | llama.cpp plain kernels {line(plain)}")
for k in ours:
    if k in peer:
        print(f"{q} {k}: kvwarden / llama.cpp = {ours[k] / peer[k]:.2f}"
              + (f" (plain kernels: {ours[k] / plain[k]:.2f})" if k in plain else ""))
PY
done
