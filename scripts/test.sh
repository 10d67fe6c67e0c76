#!/usr/bin/env bash
# The whole test suite, from a fresh clone: fetches the model, checks formatting and lints,
# runs the Rust tests, the loom model of the KV pool, and the end-to-end tests that drive a
# real server with the official OpenAI client.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/fetch-model.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo build --workspace --all-targets
cargo test --workspace
