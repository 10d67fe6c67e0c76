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
if hits=$(git grep -n -I -E '\.\./shared|shared/golden' -- \
  ':(exclude)*.md' ':(exclude)scripts/check-repo.sh'); then
  complain "code refers to files outside the repository:"
  echo "$hits" >&2
fi

exit "$fail"
