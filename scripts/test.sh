#!/usr/bin/env bash
# The whole test suite, from a fresh clone: fetches the model (and makes its requantized
# variants with llama.cpp's llama-quantize), checks formatting and lints, runs the Rust
# tests, the accuracy bar against llama.cpp's logits, the loom model of the KV pool, every
# fuzz target briefly, the incident replay (`kvwarden audit --scenario incident`), and the end-to-end tests that drive a real
# `kvwarden serve` with the official OpenAI client (with `kvwarden audit` and the fault
# suite), then the same end-to-end suite against `kvwarden router` in front of a prefill and
# a decode node.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each stage's start, in seconds since this script's: where the run's time goes (CI keeps
# the whole well under an hour on 2 cores).
stage() { echo "test.sh: [${SECONDS} s] $*" >&2; }

./scripts/check-repo.sh
./scripts/fetch-model.sh
# Gemma 3 270M (the gemma3 tests in crates/model, crates/tokenizer and tests/python).
./scripts/fetch-gemma3.sh
# The default model requantized by llama.cpp's llama-quantize (built once into .peer/, a few
# minutes on 2 cores) to the K-quant presets: crates/model/tests/llama_references.rs and
# tests/python/test_quant_models.py run on them.
./scripts/fetch-quant-models.sh
# Synthetic random-weight qwen2 and qwen3 files (crates/model/tests/llama_references.rs).
./scripts/make-synthetic-models.sh
python=$(./scripts/python-env.sh)

stage "formatting, lints, docs"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# Doc links name items that exist (module docs are where the kernels' notes live).
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps -q
stage "cargo test --workspace"
cargo test --workspace
# The container image and the Helm chart (deploy/): the chart linted, rendered and validated
# against the Kubernetes API schemas, the image built around the binary just built and run.
stage "deploy checks"
./scripts/check-deploy.sh
# Tests that need CPU features not every machine has are ignored by default: run them
# where they can run, and say so where they cannot, instead of passing silently.
stage "CPU-specific model tests"
if grep -qw avx512_vnni /proc/cpuinfo 2>/dev/null; then
  cargo test -p model --lib -- --ignored
  if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
    # This CPU ran the k-quants' prefill products on AMX tiles above: the tiles' tests once
    # more on the AVX-512 kernels, which CPUs without AMX run.
    KVWARDEN_CPU=avx512 cargo test -p model --lib -- --ignored interleaved
  else
    echo "test.sh: NOT RUN: the AMX tile kernels' tests (this CPU lacks AMX-INT8; the tests above ran its AVX-512 kernels)" >&2
  fi
  # This CPU runs the AVX-512 kernels above; the whole-model references once more on the
  # 256-bit ones, which AVX2-only machines run.
  KVWARDEN_CPU=avx2 cargo test -p model --test golden_completions --test llama_references
else
  echo "test.sh: NOT RUN: the ignored model tests (AVX-512 VNNI kernels against the 256-bit ones; this CPU lacks AVX-512 VNNI)" >&2
fi
# The accuracy oracle (crates/eval): llama.cpp's reference log-probabilities on a fixed text
# (llama-perplexity, built into .peer/; recorded into target/eval-refs/), the bar every
# arithmetic change must clear, on the default model and two other files, and the same bytes
# on every CPU path this machine has, with windows fed whole, in chunks and in batches; and
# (--lora) the default model and a synthetic qwen2 file under a synthetic LoRA adapter
# against llama.cpp's `--lora` (their greedy tokens: crates/model/tests/llama_references.rs).
stage "accuracy oracle"
python3 scripts/eval-references.py --check --invariance --lora SmolLM2-135M-Instruct.Q4_1 \
  SmolLM2-135M-Instruct.Q4_K_M synth-qwen3-q6_k
stage "loom"
bash crates/kv/loom.sh
# Every cargo-fuzz target (fuzz/) for a short fixed time: a crash fails the run, its input
# saved in fuzz/artifacts/. `scripts/fuzz.sh 1800` is the long form. 18 s each: nine
# targets in about the 160 s that eight had at 20 s.
stage "fuzzing"
./scripts/fuzz.sh 18

# The default binary must not carry the fault-injection switch (the feature is off).
if target/debug/kvwarden serve --help | grep -q -- --inject-fault; then
  echo "test.sh: the default kvwarden binary was built with fault injection" >&2
  exit 1
fi
# The fault-injection build: tests/python/test_audit.py proves the audit catches the
# incident's bug in it. It is built in target/ itself, where cargo keeps both feature sets'
# artifacts side by side, so only the crates the feature touches are compiled again (its own
# target dir rebuilt every dependency, minutes on 2 cores); the binary moves to
# target/fault/debug and the normal one goes back where `cargo test` put it.
stage "fault-injection build"
cp target/debug/kvwarden target/debug/kvwarden.normal
cargo build -p kvwarden --features fault-injection
mkdir -p target/fault/debug
# When the fault build was already up to date, cargo links the binary it moved here last
# time back into target/debug: the same file, which mv refuses to move onto itself.
rm -f target/fault/debug/kvwarden
mv -f target/debug/kvwarden target/fault/debug/kvwarden
mv -f target/debug/kvwarden.normal target/debug/kvwarden
if ! target/fault/debug/kvwarden serve --help | grep -q -- --inject-fault; then
  echo "test.sh: target/fault/debug/kvwarden lacks fault injection" >&2
  exit 1
fi

# The incident replay (its output is shown in the README).
target/debug/kvwarden --threads 2 audit --scenario incident

# The end-to-end suite runs the binary that `cargo test` just built (optimized dev profile).
# The fault suite's long form (scripts/faults.sh --long) is not part of this run.
long=(--ignore tests/python/test_faults_netns.py --ignore tests/python/test_faults_more.py)
stage "end-to-end suite"
"$python" -m pytest tests/python -q --durations=12 "${long[@]}"
# Every fixture becomes router + prefill node + decode node: the router must answer exactly
# as `serve` does.
# (test_cluster.py, test_dns_discovery.py, test_tracing.py and the fault suite test_faults.py
# start their own clusters and ran above.)
# test_gemma3.py and test_quant_models.py start their own `serve` and ran above.
stage "end-to-end suite through the router"
KVWARDEN_DEPLOYMENT=cluster "$python" -m pytest tests/python -q --durations=12 --ignore tests/python/test_cluster.py \
  --ignore tests/python/test_dns_discovery.py --ignore tests/python/test_faults.py --ignore tests/python/test_gemma3.py \
  --ignore tests/python/test_quant_models.py --ignore tests/python/test_tracing.py "${long[@]}"
stage "done"
