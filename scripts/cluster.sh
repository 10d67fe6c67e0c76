#!/usr/bin/env bash
# Serves the default model disaggregated on one machine: a prefill node, a decode node and
# a router in front of them on http://127.0.0.1:8000 (the same OpenAI API as serve.sh).
# Internal traffic uses mutual TLS with a throwaway CA made here in .cluster/certs.
# Extra arguments go to `kvwarden router`. Ctrl-C stops all three.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/fetch-model.sh
cargo build --release -p kvwarden
bin=target/release/kvwarden
dir=.cluster
mkdir -p "$dir"
[ -f "$dir/certs/ca.pem" ] || "$bin" certs --out "$dir/certs" --name router --name prefill0 --name decode0
tls() { echo --tls-ca "$dir/certs/ca.pem" --tls-cert "$dir/certs/$1.pem" --tls-key "$dir/certs/$1.key"; }

pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT INT TERM
node() { # role name
  "$bin" --threads 1 serve --role "$1" --port 0 --metrics-port 0 $(tls "$2") 2>"$dir/$2.log" &
  pids+=($!)
}
address() { # log
  for _ in $(seq 600); do
    a=$(grep -o 'internal API on [0-9.:]*' "$1" | awk '{print $4}') && [ -n "$a" ] && { echo "$a"; return; }
    sleep 0.1
  done
  echo "cluster: node did not start, see $1" >&2; cat "$1" >&2; exit 1
}
node prefill prefill0
node decode decode0
prefill=$(address "$dir/prefill0.log")
decode=$(address "$dir/decode0.log")
grep -h 'metrics on' "$dir/prefill0.log" "$dir/decode0.log" >&2
"$bin" router --prefill "$prefill" --decode "$decode" $(tls router) "$@" &
pids+=($!)
wait -n
