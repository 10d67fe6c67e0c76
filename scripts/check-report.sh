#!/usr/bin/env bash
# Checks an HTML report of `kvwarden audit` in a real headless browser (Chromium from
# Debian's packages: apt-get install chromium): the page renders (a PNG screenshot is
# written next to it) and its DOM, as the browser built it, holds the run's numbers from
# the JSON report written by the same run. The page is loaded with the network disabled,
# so a report that needed a fetch would show it.
#
#   scripts/check-report.sh REPORT.html REPORT.json [SCREENSHOT.png]
#
# Without arguments it runs a short audit against a fresh `kvwarden serve` (default model,
# small context) and checks that report.
set -euo pipefail
cd "$(dirname "$0")/.."
browser=$(command -v chromium || command -v chromium-browser || true)
[ -n "$browser" ] || { echo "check-report: chromium not found (apt-get install chromium)" >&2; exit 1; }

work=$(mktemp -d)
server_pid=
cleanup() {
  [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

if [ $# -ge 2 ]; then
  html=$1 json=$2 png=${3:-${1%.html}.png}
else
  ./scripts/fetch-model.sh
  bin=target/debug/kvwarden
  [ -x "$bin" ] || cargo build -p kvwarden
  "$bin" --threads 2 serve --port 0 --kv-pool-tokens 1024 2>"$work/serve.log" &
  server_pid=$!
  for _ in $(seq 1 600); do
    url=$(grep -o 'http://[0-9.]*:[0-9]*' "$work/serve.log" | head -1 || true)
    [ -n "$url" ] && break
    sleep 0.1
  done
  [ -n "$url" ] || { cat "$work/serve.log" >&2; exit 1; }
  html=target/audit-report.html json=target/audit-report.json png=target/audit-report.png
  "$bin" audit --endpoint "$url" --no-progress --requests 8 --max-tokens 8 --batch-invariant \
    --side-channel-tokens 256 --side-channel-trials 1 --json "$json" --html "$html" || true
fi

flags=(--headless --no-sandbox --disable-gpu --no-first-run --disable-extensions
  --user-data-dir="$work/profile" --proxy-server=127.0.0.1:9 --proxy-bypass-list='<-loopback>')
"$browser" "${flags[@]}" --window-size=1280,2400 --hide-scrollbars \
  --screenshot="$(realpath -m "$png")" "file://$(realpath "$html")" 2>"$work/shot.log" || { cat "$work/shot.log" >&2; exit 1; }
[ -s "$png" ] || { echo "check-report: no screenshot written" >&2; exit 1; }
"$browser" "${flags[@]}" --dump-dom "file://$(realpath "$html")" >"$work/dom.html" 2>"$work/dom.log" \
  || { cat "$work/dom.log" >&2; exit 1; }

python3 - "$json" "$work/dom.html" <<'PY'
import html, json, re, sys
report = json.load(open(sys.argv[1]))
dom = open(sys.argv[2], encoding="utf-8").read()
problems = []

def cell(id_):
    m = re.search(r'id="%s"[^>]*>([^<]*)<' % re.escape(id_), dom)
    return html.unescape(m.group(1)).strip() if m else None

def expect(id_, value):
    got = cell(id_)
    if got != str(value):
        problems.append(f"#{id_}: the page shows {got!r}, the run had {value!r}")

expect("max-context", report["max_context"])
expect("model", report["model"])
expect("requests-count", len(report["requests"]))
expect("leaks-count", len(report["leaks"]))
failures = sum(f["severity"] == "failure" for f in report["findings"])
expect("failures-count", failures)
expect("warnings-count", len(report["findings"]) - failures)
expect("differential-compared", report["differential"]["compared"])
expect("differential-identical", report["differential"]["identical"])
for i, c in enumerate(report["capacity"]):
    expect(f"capacity-status-{i}", c["status"] if c["status"] is not None else "-")
verdict = cell("verdict") or ""
if ("PASS" in verdict) != report["passed"]:
    problems.append(f"verdict banner {verdict!r} disagrees with passed={report['passed']}")
# Every request is a row of the requests table, with its status.
table = dom.split('id="requests"', 1)[-1].split("</table>", 1)[0]
rows = re.findall(r"<tr><td class=\"num\">(\d+)</td>", table)
if sorted(map(int, rows)) != sorted(r["id"] for r in report["requests"]):
    problems.append(f"requests table has {len(rows)} rows, the run had {len(report['requests'])}")
for c in report["checks"]:
    if c["title"] not in dom:
        problems.append(f"check {c['title']!r} missing")
if dom.count("<circle") != len(report["requests"]):
    problems.append(f"latency chart has {dom.count('<circle')} dots for {len(report['requests'])} requests")
if re.search(r'(src|href)="(https?:)?//', dom):
    problems.append("the page references a network resource")
if problems:
    print("check-report: FAILED\n  " + "\n  ".join(problems))
    sys.exit(1)
print(f"check-report: ok: {len(report['requests'])} requests, {len(report['leaks'])} leaks, "
      f"context {report['max_context']}, verdict {'PASS' if report['passed'] else 'FAIL'}")
PY
echo "check-report: screenshot at $png"
