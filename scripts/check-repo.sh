#!/usr/bin/env bash
# Static checks of the repository itself, run first by scripts/test.sh (they take a second).
# Each one guards a promise that no compiler or test would otherwise notice breaking.
set -euo pipefail
cd "$(dirname "$0")/.."

fail=0
complain() {
  echo "check-repo: $*" >&2
  fail=1
}

# A plain clone must pass its own tests: nothing may read files from outside the repository
# (the reference outputs live in tests/data/golden/). Documentation may mention the shared
# folder; code, scripts and configuration may not.
if hits=$(git grep -n -I -E '\.\./shar[e]d|shar[e]d/golden' -- \
  ':(exclude)*.md' ':(exclude)scripts/check-repo.sh' ':(exclude).ci/run'); then
  complain "code refers to files outside the repository:"
  echo "$hits" >&2
fi

# Unsafe code lives only in the model crate's SIMD kernels and in gguf's mapping of the
# model file (gguf denies it everywhere else); every other crate forbids it.
for root in crates/*/src/lib.rs crates/*/src/main.rs; do
  case "$root" in crates/model/*) continue ;; esac
  if [ "$root" = crates/gguf/src/lib.rs ]; then
    grep -q '^#!\[deny(unsafe_code)\]' "$root" || complain "$root lacks #![deny(unsafe_code)]"
    allowed=$(grep -c '^#\[allow(unsafe_code)\]' "$root")
    [ "$allowed" = 1 ] && grep -A1 '^#\[allow(unsafe_code)\]' "$root" | grep -q '^mod mapping;' \
      || complain "$root allows unsafe code elsewhere than its mapping module"
    continue
  fi
  grep -q '^#!\[forbid(unsafe_code)\]' "$root" || complain "$root lacks #![forbid(unsafe_code)]"
done

# ARCHITECTURE.md keeps its threat model: who can reach what, and what each boundary checks.
for section in '## Threat model' '### Clients' '### Other tenants' '### Operators' '### Other nodes' '### Out of scope'; do
  grep -q "^$section" ARCHITECTURE.md || complain "ARCHITECTURE.md lacks the threat model section '$section'"
done

# Within `model`, unsafe code lives only in the SIMD kernels (`kernels/`) and in the weight
# formats' run-time dispatch into them (`quant/`: the CPU check, then the call), and every
# unsafe block carries its `// SAFETY:` argument just above it.
if hits=$(git grep -n -w 'unsafe' -- 'crates/model/src' ':(exclude)crates/model/src/kernels/' \
  ':(exclude)crates/model/src/quant/' | grep -v '^[^:]*:[0-9]*: *//'); then
  complain "unsafe code outside crates/model/src/kernels/ and crates/model/src/quant/:"
  echo "$hits" >&2
fi
if hits=$(python3 - <<'PY'
import re, subprocess
files = subprocess.run(["git", "ls-files", "crates/model/src", "crates/gguf/src/mapping.rs"],
                       capture_output=True, text=True).stdout.split()
for f in files:
    lines = open(f, encoding="utf-8").read().split("\n")
    for i, line in enumerate(lines):
        if re.search(r"\bunsafe\s*\{", line) and not line.lstrip().startswith("//"):
            if "SAFETY" not in "\n".join(lines[max(0, i - 10):i + 1]):
                print(f"{f}:{i + 1}: {line.strip()}")
PY
); [ -n "$hits" ]; then
  complain "unsafe blocks without a // SAFETY: comment in the ten lines above:"
  echo "$hits" >&2
fi

# The kv feature that skips the read checks (a baseline for bench/kv-checks.sh, which builds
# it into its own target dir) is enabled by no manifest: no build of a crate can pull it in.
if hits=$(git grep -n 'bench-unchecked-baseline' -- '*.toml' ':(exclude)crates/kv/Cargo.toml'); then
  complain "a manifest enables kv's bench-unchecked-baseline (the read checks off):"
  echo "$hits" >&2
fi
grep -q '^bench-unchecked-baseline = \[\]$' crates/kv/Cargo.toml ||
  complain "crates/kv/Cargo.toml: bench-unchecked-baseline must enable nothing else"

# ARCHITECTURE.md names only files and Rust items that exist, so the map stays true as code
# moves (scripts/check-architecture.py says what it resolves and how).
python3 scripts/check-architecture.py || fail=1

# Every crate inherits the workspace's rust-version, so that clippy (run with -D warnings by
# test.sh) refuses any API newer than the minimum the manifest states (incompatible_msrv).
for manifest in crates/*/Cargo.toml; do
  grep -q '^rust-version.workspace = true' "$manifest" ||
    complain "$manifest does not inherit rust-version from the workspace"
done

# Every declared dependency is named somewhere in the code that may use it (a dependency
# nothing uses is build time, supply-chain surface and a false account of the design).
for manifest in crates/*/Cargo.toml; do
  crate=$(dirname "$manifest")
  while read -r kind dep; do
    ident=${dep//-/_}
    dirs=("$crate/src")
    [ -f "$crate/build.rs" ] && dirs+=("$crate/build.rs")
    if [ "$kind" = dev ]; then
      for d in tests benches examples; do
        [ -d "$crate/$d" ] && dirs+=("$crate/$d")
      done
    fi
    # The crate itself (a dev-dependency on itself turns on its test features).
    [ "$ident" = "$(basename "$crate")" ] && continue
    grep -rqw -- "$ident" "${dirs[@]}" || complain "$manifest: dependency '$dep' is not used"
  done < <(awk '
    /^\[/ { section = $0; next }
    section ~ /dependencies\]$/ && /^[A-Za-z0-9_-]+ *(=|\.)/ {
      split($0, parts, /[ .=]/)
      print (section ~ /dev-dependencies/ ? "dev" : "normal"), parts[1]
    }' "$manifest")
done
# ...and every workspace-level dependency is declared by some crate.
while read -r dep; do
  grep -qE "^$dep *(=|\.)" crates/*/Cargo.toml || complain "Cargo.toml: workspace dependency '$dep' is used by no crate"
done < <(awk '/^\[/ { section = $0; next }
  section == "[workspace.dependencies]" && /^[A-Za-z0-9_-]+ *=/ { split($0, p, /[ =]/); print p[1] }' Cargo.toml)

exit "$fail"
