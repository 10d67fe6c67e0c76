#!/usr/bin/env bash
# kvwarden against llama.cpp's own llama-bench on the K-quant files (Q4_K_M and Q6_K, made by
# scripts/fetch-quant-models.sh), same files, same run, same thread count: pp512 and tg128
# in tokens per second, and their ratios. llama-bench is built from the same sdist as the
# references (bench/build-llama-server.sh llama-bench, cached in .peer/), flash attention on
# as in the references, its other settings its defaults. Run on an otherwise idle machine;
# timings are never pass/fail tests. QUANTS="Q4_K_M Q6_K" and THREADS override the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${THREADS:-$(nproc)}
np=${BENCH_PP:-512}
ng=${BENCH_TG:-128}
./scripts/fetch-quant-models.sh
llama_bench=$(./bench/build-llama-server.sh llama-bench)
for q in ${QUANTS:-Q4_K_M Q6_K}; do
  file=SmolLM2-135M-Instruct.$q.gguf
  ours=$(BENCH_MODEL=$file BENCH_PP=$np BENCH_TG=$ng RAYON_NUM_THREADS=$threads \
    cargo bench -q -p model --bench throughput 2>/dev/null | tail -1)
  theirs=$("$llama_bench" -m "models/$file" -p "$np" -n "$ng" -t "$threads" -fa 1 -o json 2>/dev/null)
  python3 - "$q" "$ours" "$theirs" "$np" "$ng" <<'PY'
import json, re, sys
q, ours, theirs, np_, ng = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
ours = {k: float(v) for k, v in re.findall(r"(pp\d+|tg\d+)=([0-9.]+)", ours)}
peer = {}
for run in theirs:
    key = f"pp{run['n_prompt']}" if run["n_prompt"] else f"tg{run['n_gen']}"
    peer[key] = run["avg_ts"]
print(f"{q}: kvwarden " + " ".join(f"{k}={v:.1f}" for k, v in ours.items())
      + " | llama.cpp " + " ".join(f"{k}={v:.1f}" for k, v in peer.items()))
for k in ours:
    if k in peer:
        print(f"{q} {k}: kvwarden / llama.cpp = {ours[k] / peer[k]:.2f}")
PY
done
