#!/usr/bin/env bash
# Fetches llama.cpp's tokenizer test vocabularies (vendor/llama.cpp/models/ggml-vocab-*.gguf
# with their .inp/.out case files) and its chat-template corpus (models/templates/*.jinja,
# into templates/ of the same folder) from the PyPI sdist llama-cpp-python==0.3.36, which
# vendors ggml-org/llama.cpp@0c1e57098 (the reference the goldens were recorded with).
# The sdist is checked by sha256 and never built: only those files are extracted, into the
# git-ignored models/llama-vocabs/. Idempotent. Prints the folder on stdout; fails loudly.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/models/llama-vocabs"
version=0.3.36
sdist_sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
stamp="$dest/.sdist.sha256"
# The stamp names what was extracted, so a folder from before the templates were added is
# extracted again.
want="$sdist_sha vocabs+templates"

# Tests call this concurrently (several test binaries and threads): one fetches while the
# others wait, then find the stamp, instead of replacing the folder under a reader.
mkdir -p "$(dirname "$dest")"
exec 9>"$(dirname "$dest")/.llama-vocabs.lock"
flock 9

if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "$dest"
  exit 0
fi
command -v python3 >/dev/null || { echo "fetch-llama-vocabs: python3 is required" >&2; exit 1; }
python3 -m pip --version >/dev/null 2>&1 || { echo "fetch-llama-vocabs: pip is required (python3 -m pip)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch-llama-vocabs: downloading the llama-cpp-python==$version sdist from PyPI" >&2
if ! python3 -m pip download --quiet --disable-pip-version-check --no-deps \
  --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$tmp" >&2; then
  echo "fetch-llama-vocabs: pip download failed (is the network to PyPI reachable?)" >&2
  exit 1
fi
sdist="$tmp/llama_cpp_python-$version.tar.gz"
[ -f "$sdist" ] || { echo "fetch-llama-vocabs: pip did not produce $sdist" >&2; exit 1; }
echo "$sdist_sha  $sdist" | sha256sum --check --status || {
  echo "fetch-llama-vocabs: sha256 mismatch for $sdist" >&2
  exit 1
}
prefix="llama_cpp_python-$version/vendor/llama.cpp/models"
tar -xzf "$sdist" -C "$tmp" --wildcards "$prefix/ggml-vocab-*" "$prefix/templates/*"
count=$(find "$tmp/$prefix" -name 'ggml-vocab-*.gguf' | wc -l)
if [ "$count" -lt 10 ]; then
  echo "fetch-llama-vocabs: only $count vocabularies in the sdist; expected llama.cpp's test set" >&2
  exit 1
fi
rm -rf "$dest"
mkdir -p "$(dirname "$dest")"
mv "$tmp/$prefix" "$dest"
templates=$(find "$dest/templates" -name '*.jinja' | wc -l)
if [ "$templates" -lt 20 ]; then
  echo "fetch-llama-vocabs: only $templates chat templates in the sdist; expected llama.cpp's corpus" >&2
  exit 1
fi
echo "$want" > "$stamp"
echo "fetch-llama-vocabs: stored $count vocabularies and $templates chat templates in $dest" >&2
echo "$dest"
