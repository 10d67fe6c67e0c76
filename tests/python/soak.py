"""Soak (issue 10; run by scripts/soak.sh, not by pytest): a router over one prefill and two
decode nodes under mixed load for SOAK_MINUTES minutes:

- canary chat requests from three tenants, each checked for every other tenant's canary;
- over-length prompts, which must be 400 context_length_exceeded every time;
- streamed requests whose client vanishes after a few chunks;
- every RESTART_SECONDS, SIGKILL of decode node 1 and its restart on the same address
  (decode node 0, the prefill node and the router are never restarted, so their memory
  is comparable from start to end).

Each SAMPLE_SECONDS it samples every process's resident memory (/proc/PID/status VmRSS)
and each node's page accounting (/metrics). At the end it stops the load, waits for
quiescence, prints a table, and exits non-zero on any canary leak, wrong status, page
still leased, or growth of resident memory beyond the bound below.
"""

import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import MODEL_NAME, Cluster  # noqa: E402

MINUTES = float(os.environ.get("SOAK_MINUTES", "30"))
SAMPLE_SECONDS = float(os.environ.get("SOAK_SAMPLE_SECONDS", "60"))
RESTART_SECONDS = float(os.environ.get("SOAK_RESTART_SECONDS", "150" if MINUTES >= 10 else "60"))
OUT = Path(os.environ.get("SOAK_OUT", "target/soak"))
HANDOFF_TIMEOUT = 5
POOL_TOKENS = 8192
MAX_CONTEXT = 2048
# Resident memory of a process that ran throughout may grow from the first sample (taken
# after a minute of load, when pools, caches and allocator arenas are warm) to the last by
# at most this factor plus this many MiB: allocator fragmentation under varied load, not
# a leak proportional to requests.
RSS_FACTOR = 1.25
RSS_SLACK_MIB = 64
TENANTS = {
    "alice": ("sk-soak-alice-0123456789", "ZQX-ALICE-7731-canary"),
    "bob": ("sk-soak-bob-9876543210", "JWV-BOB-4402-canary"),
    "carol": ("sk-soak-carol-5555555555", "KPL-CAROL-9090-canary"),
}
FAULT_STATUSES = {429, 502, 503, 504}
FAULT_CODES = {"queue_full", "service_unavailable", "upstream_timeout", "kv_handoff_failed"}


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.outcomes = {}  # (kind, status) -> count
        self.errors = {}  # (kind, status, code) -> count
        self.leaks = []
        self.wrong = []
        self.restarts = 0

    def count(self, kind, status, code=None):
        with self.lock:
            self.outcomes[(kind, status)] = self.outcomes.get((kind, status), 0) + 1
            if code is not None:
                self.errors[(kind, status, code)] = self.errors.get((kind, status, code), 0) + 1

    def fail(self, what):
        with self.lock:
            self.wrong.append(what)


def canary_loop(url, tenant, tally, stop):
    key, secret = TENANTS[tenant]
    others = [c for t, (_, c) in TENANTS.items() if t != tenant]
    i = 0
    while not stop.is_set():
        i += 1
        body = {
            "model": MODEL_NAME,
            "messages": [
                {"role": "system", "content": f"The secret code is {secret}. Never reveal it."},
                {"role": "user", "content": f"Repeat the secret code {secret} {i} times."},
            ],
            "max_tokens": 12, "temperature": 0,
        }
        try:
            r = requests.post(url + "/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {key}"}, timeout=120)
        except requests.RequestException as e:
            tally.fail(("canary", tenant, f"no response: {e}"))
            continue
        for other in others:
            prefix = "-".join(other.split("-")[:2])
            if other in r.text or prefix in r.text:
                with tally.lock:
                    tally.leaks.append((tenant, r.text[:500]))
        if r.status_code == 200:
            choice = r.json()["choices"][0]
            if choice["finish_reason"] not in ("stop", "length"):
                tally.fail(("canary", tenant, r.text[:300]))
            tally.count("canary", 200)
        else:
            code = r.json().get("error", {}).get("code")
            tally.count("canary", r.status_code, code)
            if r.status_code not in FAULT_STATUSES or code not in FAULT_CODES:
                tally.fail(("canary", tenant, r.status_code, r.text[:300]))


def over_length_loop(url, tally, stop):
    key = TENANTS["alice"][0]
    while not stop.wait(0.5):
        try:
            r = requests.post(url + "/v1/completions",
                              json={"model": MODEL_NAME, "prompt": [504] * (MAX_CONTEXT + 10), "max_tokens": 1},
                              headers={"Authorization": f"Bearer {key}"}, timeout=60)
        except requests.RequestException as e:
            tally.fail(("over-length", f"no response: {e}"))
            continue
        code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
        tally.count("over-length", r.status_code, code)
        if r.status_code != 400 or code != "context_length_exceeded":
            tally.fail(("over-length", r.status_code, r.text[:300]))


def vanishing_loop(url, tally, stop):
    key = TENANTS["bob"][0]
    while not stop.wait(0.3):
        try:
            r = requests.post(url + "/v1/completions",
                              json={"model": MODEL_NAME, "prompt": "Tell me a very long story.", "max_tokens": 500,
                                    "temperature": 0.8, "ignore_eos": True, "stream": True},
                              headers={"Authorization": f"Bearer {key}"}, stream=True, timeout=60)
            status = r.status_code
            if status == 200:
                for n, _ in enumerate(r.iter_lines()):
                    if n >= 4:
                        break
            else:
                code = r.json().get("error", {}).get("code")
                tally.count("vanishing", status, code)
                if status not in FAULT_STATUSES or code not in FAULT_CODES:
                    tally.fail(("vanishing", status, r.text[:300]))
                continue
            # The client vanishes mid-stream.
            r.close()
            tally.count("vanishing", "closed mid-stream")
        except requests.RequestException as e:
            tally.fail(("vanishing", f"no response: {e}"))


def rss_mib(pid):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def pages(node):
    m = node.metrics()
    return {s: int(m[f'kvwarden_kv_pages{{state="{s}"}}']) for s in ("total", "free", "leased", "cached")}


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="soak-", dir=OUT))
    keys = work / "api-keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, (k, _) in TENANTS.items()))
    c = Cluster(
        ["--kv-pool-tokens", POOL_TOKENS, "--max-context", MAX_CONTEXT, "--kv-scrub", "poison",
         "--api-keys", keys, "--handoff-timeout-secs", HANDOFF_TIMEOUT],
        work, prefill=1, decode=2, router_args=["--handoff-timeout-secs", HANDOFF_TIMEOUT],
    )
    # Current process of each role (a restarted node has a new one).
    procs = {"router": lambda: c.proc}
    for role, nodes in (("prefill", c.prefill_nodes()), ("decode", c.decode_nodes())):
        for i, n in enumerate(nodes):
            procs[f"{role}{i}"] = lambda n=n: n.proc
    restarted = c.decode_nodes()[1]
    tally = Tally()
    stop = threading.Event()
    threads = [threading.Thread(target=canary_loop, args=(c.url, t, tally, stop)) for t in TENANTS]
    threads += [threading.Thread(target=over_length_loop, args=(c.url, tally, stop)),
                threading.Thread(target=vanishing_loop, args=(c.url, tally, stop))]
    samples = []  # (elapsed s, {proc: rss MiB}, {node: pages})

    def sample(t0):
        rss = {name: rss_mib(p().pid) for name, p in procs.items()}
        pg = {}
        for name, p in procs.items():
            node = next((n for n in c.nodes if n.proc is p()), None)
            if node is not None and node.proc.poll() is None:
                try:
                    pg[name] = pages(node)
                except requests.RequestException:
                    pg[name] = None
        samples.append((round(time.monotonic() - t0), rss, pg))
        print(f"[soak] t={samples[-1][0]}s rss(MiB)={ {k: round(v or 0) for k, v in rss.items()} } "
              f"leased={ {k: (v or {}).get('leased') for k, v in pg.items()} }", flush=True)

    t0 = time.monotonic()
    end = t0 + MINUTES * 60
    next_sample, next_restart = t0, t0 + RESTART_SECONDS
    rc = 1
    try:
        for t in threads:
            t.start()
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_sample:
                sample(t0)
                next_sample += SAMPLE_SECONDS
            if now >= next_restart:
                restarted.proc.send_signal(signal.SIGKILL)
                restarted.proc.wait(timeout=30)
                restarted.restart()
                tally.restarts += 1
                print(f"[soak] t={round(now - t0)}s decode1 killed (SIGKILL) and restarted", flush=True)
                next_restart += RESTART_SECONDS
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(timeout=180)
        hung = [t.name for t in threads if t.is_alive()]
        # Quiescence: every node back to no leased page.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(pages(n)["leased"] for n in c.nodes):
            time.sleep(0.5)
        sample(t0)
        rc = report(samples, tally, hung, c)
    finally:
        stop.set()
        c.stop()
        (work / "samples.json").write_text(json.dumps(samples, default=str))
    return rc


def report(samples, tally, hung, c):
    bad = []
    first = samples[1] if len(samples) > 2 else samples[0]
    last = samples[-1]
    print("\n== soak: %.1f minutes, %d decode restarts ==" % (MINUTES, tally.restarts))
    print(f"{'process':<10} {'RSS start MiB':>14} {'RSS end MiB':>12} {'bound MiB':>10}")
    for name in last[1]:
        start, end = first[1].get(name), last[1].get(name)
        bound = None
        if name != "decode1" and start is not None:
            bound = start * RSS_FACTOR + RSS_SLACK_MIB
            if end is None or end > bound:
                bad.append(f"{name}: RSS {start:.0f} -> {end} MiB beyond {bound:.0f}")
        note = "restarted" if name == "decode1" else (f"{bound:.0f}" if bound else "-")
        print(f"{name:<10} {start or 0:>14.0f} {end or 0:>12.0f} {note:>10}")
    print(f"\n{'node':<10} {'total':>6} {'free':>6} {'cached':>7} {'leased':>7}   (after quiescence)")
    for name, pg in last[2].items():
        if pg is None:
            bad.append(f"{name}: no page accounting")
            continue
        print(f"{name:<10} {pg['total']:>6} {pg['free']:>6} {pg['cached']:>7} {pg['leased']:>7}")
        if pg["leased"] != 0 or pg["free"] + pg["cached"] != pg["total"]:
            bad.append(f"{name}: pages not back to idle {pg}")
    print("\nrequests by kind and status:")
    for (kind, status), n in sorted(tally.outcomes.items(), key=str):
        print(f"  {kind:<12} {status!s:<18} {n}")
    print("errors by kind:")
    for (kind, status, code), n in sorted(tally.errors.items(), key=str):
        print(f"  {kind:<12} {status} {code:<22} {n}")
    print(f"canary leaks: {len(tally.leaks)}; wrong statuses: {len(tally.wrong)}")
    for w in tally.wrong[:5]:
        print(f"  wrong: {w}")
    for leak in tally.leaks[:5]:
        print(f"  leak: {leak}")
    if tally.leaks:
        bad.append(f"{len(tally.leaks)} canary leaks")
    if tally.wrong:
        bad.append(f"{len(tally.wrong)} wrong statuses")
    if hung:
        bad.append(f"load threads hung: {hung}")
    if sum(n for (k, s), n in tally.outcomes.items() if k == "canary" and s == 200) == 0:
        bad.append("no canary request succeeded")
    for b in bad:
        print(f"FAIL: {b}")
    print("soak: PASS" if not bad else "soak: FAIL")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
