#!/usr/bin/env bash
# Creates .venv with the end-to-end test dependencies (tests/python/requirements.txt).
# Idempotent: reinstalls only when the requirements changed. Prints the venv's python.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
req="$root/tests/python/requirements.txt"
stamp="$venv/.requirements.sha256"

if [ ! -x "$venv/bin/python" ]; then
  echo "python-env: creating $venv" >&2
  python3 -m venv "$venv" || {
    echo "python-env: 'python3 -m venv' failed (on Debian: apt-get install python3-venv)" >&2
    exit 1
  }
fi
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "python-env: installing $(tr '\n' ' ' < <(grep -v '^#' "$req"))" >&2
  if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2; then
    echo "python-env: pip install failed (is PyPI reachable?)" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
