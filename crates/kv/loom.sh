#!/usr/bin/env bash
# Loom model check of the KV pool's concurrency (tests/loom_pool.rs). A separate target
# directory keeps the `--cfg loom` build from invalidating the normal one.
set -euo pipefail
cd "$(dirname "$0")/../.."
export RUSTFLAGS="${RUSTFLAGS:-} --cfg loom"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/loom"
exec cargo test -p kv --test loom_pool --release "$@"
