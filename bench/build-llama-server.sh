#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (and, beside it, `llama-quantize`, `llama-bench` and
# `llama-perplexity`) from
# the PyPI sdist of llama-cpp-python (which vendors llama.cpp) into .peer/ (git-ignored): the
# peer that `kvwarden audit`, `bench/` and the model-breadth references are measured against.
# Cached: a second run prints the path at once. About 10 minutes on 2 cores, run at the
# lowest CPU priority so it does not starve other work. Needs cmake, ninja and a C++
# compiler (Debian: apt-get install cmake ninja-build g++). Prints the binary's path.
#
# With one argument (`llama-quantize`, `llama-bench` or `llama-perplexity`) it builds only
# that tool, which is what a fresh clone needs to requantize the test models
# (scripts/fetch-quant-models.sh) or record the eval references (scripts/eval-references.py),
# and prints its path.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
version=0.3.36
peer="$root/.peer"
only=${1:-}
case "$only" in
  "") ;;
  llama-quantize | llama-bench | llama-perplexity)
    if [ -x "$peer/$only-$version" ]; then
      echo "$peer/$only-$version"
      exit 0
    fi
    ;;
  *) echo "build-llama-server: unknown tool $only (llama-quantize, llama-bench or llama-perplexity)" >&2; exit 2 ;;
esac
bin="$peer/llama-server-$version"
if [ -z "$only" ] && [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi
# A fresh machine may lack the build tools: install them where we may (root with apt-get),
# as the README promises that the project's own scripts install what they need.
missing=()
for tool in cmake ninja c++; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "build-llama-server: installing cmake ninja-build g++ (missing: ${missing[*]})" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake ninja-build g++; } >&2
fi
for tool in cmake ninja c++; do
  command -v "$tool" >/dev/null || { echo "build-llama-server: $tool is required (apt-get install cmake ninja-build g++)" >&2; exit 1; }
done
mkdir -p "$peer"
src="$peer/src-$version"
if [ ! -d "$src/vendor/llama.cpp" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "build-llama-server: downloading the llama-cpp-python==$version sdist from PyPI" >&2
  python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$version" -d "$tmp" >&2
  mkdir -p "$src"
  tar -xzf "$tmp"/llama_cpp_python-"$version".tar.gz -C "$src" --strip-components=1
fi
echo "build-llama-server: building ${only:-llama-server} (about 10 minutes on 2 cores)" >&2
nice -n 19 cmake -S "$src/vendor/llama.cpp" -B "$peer/build-$version" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON >&2
if [ -n "$only" ]; then
  nice -n 19 cmake --build "$peer/build-$version" --target "$only" -j "$(nproc)" >&2
  cp "$peer/build-$version/bin/$only" "$peer/$only-$version.tmp"
  mv "$peer/$only-$version.tmp" "$peer/$only-$version"
  echo "$peer/$only-$version"
  exit 0
fi
nice -n 19 cmake --build "$peer/build-$version" --target llama-server llama-quantize llama-bench \
  llama-perplexity -j "$(nproc)" >&2
for tool in llama-quantize llama-bench llama-perplexity; do
  cp "$peer/build-$version/bin/$tool" "$peer/$tool-$version.tmp"
  mv "$peer/$tool-$version.tmp" "$peer/$tool-$version"
done
cp "$peer/build-$version/bin/llama-server" "$bin.tmp"
mv "$bin.tmp" "$bin"
echo "$bin"
