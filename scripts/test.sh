#!/usr/bin/env bash
# The whole test suite, from a fresh clone: fetches the model, checks formatting and lints,
# runs the Rust tests, the loom model of the KV pool, the incident replay
# (`kvwarden audit --scenario incident`), and the end-to-end tests that drive a real
# `kvwarden serve` with the official OpenAI client (and `kvwarden audit` against it).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/fetch-model.sh
python=$(./scripts/python-env.sh)

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
bash crates/kv/loom.sh

# The default binary must not carry the fault-injection switch (the feature is off).
if target/debug/kvwarden serve --help | grep -q -- --inject-fault; then
  echo "test.sh: the default kvwarden binary was built with fault injection" >&2
  exit 1
fi
# The fault-injection build, in its own target dir so target/debug/kvwarden stays the
# normal one: tests/python/test_audit.py proves the audit catches the incident's bug in it.
cargo build -p kvwarden --features fault-injection --target-dir target/fault

# The incident replay (its output is shown in the README).
target/debug/kvwarden --threads 2 audit --scenario incident

# The end-to-end suite runs the binary that `cargo test` just built (optimized dev profile).
"$python" -m pytest tests/python -q
