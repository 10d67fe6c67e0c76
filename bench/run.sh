#!/usr/bin/env bash
# kvwarden against llama.cpp on the same GGUF file, in the same run, same thread count.
# llama.cpp comes from the PyPI package llama-cpp-python (built from source by pip into
# .venv-bench on first use: about 10 minutes on 2 cores). Run on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${THREADS:-$(nproc)}
./scripts/fetch-model.sh
venv=.venv-bench
if ! "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  python3 -m venv "$venv"
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
    "$venv/bin/python" -m pip install --quiet llama-cpp-python==0.3.36
fi
ours=$(RAYON_NUM_THREADS=$threads cargo bench -q -p model --bench throughput 2>/dev/null | tail -1)
theirs=$("$venv/bin/python" bench/peer_llama_cpp.py models/SmolLM2-135M-Instruct.Q4_1.gguf "$threads" | tail -1)
echo "$ours"
echo "$theirs"
python3 - "$ours" "$theirs" <<'PY'
import re, sys
ours, theirs = (dict(re.findall(r"(pp\d+|tg\d+)=([0-9.]+)", s)) for s in sys.argv[1:3])
for k in ours:
    print(f"{k}: kvwarden / llama.cpp = {float(ours[k]) / float(theirs[k]):.2f}")
PY
