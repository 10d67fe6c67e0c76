"""Fault suite, short form (scripts/faults.sh runs it alone): a router over one prefill and
two decode nodes on loopback, with canary traffic from two tenants throughout, and these
faults injected one after the other:

1. SIGSTOP (a hung node) of the decode node holding a stream: that client's stream ends
   with one error event within HUNG_BOUND seconds (the router's handoff timeout, the time
   one step of a request may take, is HANDOFF_TIMEOUT); then SIGCONT.
2. SIGSTOP of the prefill node during a long prefill: that client gets an error status
   (503/504), never a 200, within HUNG_BOUND; then SIGCONT.
3. SIGKILL of a decode node mid-stream, then a restart on the same address: the router
   uses the restarted node again without operator action (it polls nodes every second).
4. SIGKILL of the router mid-stream, then a restart on the same address: the stream's client
   sees it end without [DONE] (an error), the nodes release its pages, and the restarted
   router serves both tenants again. Canary requests while the router is down fail to
   connect, which is the only error they may see then.

Throughout, every canary response is either a clean success whose text holds no other
tenant's canary, or an error in OpenAI's shape with a status a fault explains; at the end
every node (survivors and the restarted one) holds no leased page, and the cluster still
answers a golden prompt exactly. Pass/fail never depends on timings beyond liveness bounds.
"""

import json
import signal
import threading
import time
from pathlib import Path

import pytest
import requests

from conftest import MODEL_NAME, ROOT, TENANT_KEYS, Cluster, own_greedy

HANDOFF_TIMEOUT = 5
# A hung node costs its client an error within the handoff timeout plus the gRPC
# keepalive's detection and scheduling slack on a loaded 2-core machine.
HUNG_BOUND = 45
GOLDEN = json.loads((ROOT / "tests" / "data" / "golden" / "completions.json").read_text())["cases"]
CANARIES = {"alice": "ZQX-ALICE-7731-canary", "bob": "JWV-BOB-4402-canary"}
# Statuses a fault may explain: capacity, a node gone or hung, a refused handoff.
FAULT_STATUSES = {429, 502, 503, 504}
FAULT_CODES = {"queue_full", "service_unavailable", "upstream_timeout", "kv_handoff_failed"}


class Canaries:
    """One thread per tenant sending chat requests that carry the tenant's canary, and
    checking every answer for the other tenants' canaries."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.stop = threading.Event()
        self.paused = threading.Event()
        self.lock = threading.Lock()
        self.ok = {t: 0 for t in CANARIES}
        self.errors = {}  # (tenant, status, code) -> count
        self.leaks = []
        self.wrong = []
        # Set while the router is down on purpose: a connection error is then expected.
        self.router_down = threading.Event()
        self.unreachable = 0
        self.threads = [threading.Thread(target=self.run, args=(t,), daemon=True) for t in CANARIES]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=HUNG_BOUND + 30)
        assert not any(t.is_alive() for t in self.threads), "a canary client hung"

    def run(self, tenant):
        key = TENANT_KEYS[tenant]
        secret = CANARIES[tenant]
        others = [c for t, c in CANARIES.items() if t != tenant]
        i = 0
        while not self.stop.is_set():
            if self.paused.is_set():
                time.sleep(0.05)
                continue
            i += 1
            body = {
                "model": MODEL_NAME,
                "messages": [
                    {"role": "system", "content": f"The secret code is {secret}. Never reveal it."},
                    {"role": "user", "content": f"Repeat the secret code {secret} {i} times."},
                ],
                "max_tokens": 12,
                "temperature": 0,
            }
            try:
                r = requests.post(
                    self.cluster.url + "/v1/chat/completions", json=body,
                    headers={"Authorization": f"Bearer {key}"}, timeout=HUNG_BOUND + 30,
                )
            except requests.RequestException as e:
                with self.lock:
                    if self.router_down.is_set():
                        self.unreachable += 1
                    else:
                        self.wrong.append((tenant, f"no response: {e}"))
                time.sleep(0.05)
                continue
            self.check(tenant, others, r)

    def check(self, tenant, others, r):
        with self.lock:
            text = r.text
            for other in others:
                # Any fragment of another tenant's canary is a leak, whatever the status.
                for frag in (other, other.split("-")[0] + "-" + other.split("-")[1]):
                    if frag in text:
                        self.leaks.append((tenant, text))
            if r.status_code == 200:
                choice = r.json()["choices"][0]
                if choice["finish_reason"] not in ("stop", "length") or choice["message"]["role"] != "assistant":
                    self.wrong.append((tenant, text))
                else:
                    self.ok[tenant] += 1
            else:
                err = r.json().get("error", {})
                key = (tenant, r.status_code, err.get("code"))
                self.errors[key] = self.errors.get(key, 0) + 1
                if r.status_code not in FAULT_STATUSES or err.get("code") not in FAULT_CODES or not err.get("message"):
                    self.wrong.append((tenant, r.status_code, text))


def stream(cluster, prompt, max_tokens, out, started):
    """A streamed completion of Alice's; records status, data events, the end time."""
    try:
        r = requests.post(
            cluster.url + "/v1/completions",
            json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                  "ignore_eos": True, "stream": True},
            headers={"Authorization": f"Bearer {TENANT_KEYS['alice']}"}, stream=True, timeout=HUNG_BOUND + 60,
        )
        out.append(("status", r.status_code))
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                out.append(("data", line[6:]))
                started.set()
    except requests.RequestException as e:
        out.append(("error", str(e)))
    finally:
        out.append(("end", time.monotonic()))
        started.set()


def ended_with_one_error_event(events):
    data = [d for kind, d in events if kind == "data"]
    return bool(data) and b"[DONE]" not in data and "error" in json.loads(data[-1]) and sum(
        1 for d in data if d != b"[DONE]" and "error" in json.loads(d)
    ) == 1


def leased(node):
    return node.metrics()['kvwarden_kv_pages{state="leased"}']


def wait_until(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    pytest.fail(f"{what} within {timeout}s")


def busy_decode(c, canaries):
    """Places a long stream of Alice's with the canaries paused, and returns the decode node
    that holds it (the only one with leased pages then)."""
    canaries.paused.set()
    try:
        wait_until(lambda: all(leased(n) == 0 for n in c.nodes if n.proc.poll() is None), 60,
                   "canaries drained")
        events, started = [], threading.Event()
        t = threading.Thread(target=stream, args=(c, GOLDEN[1]["prompt_tokens"], 3000, events, started))
        t.start()
        assert started.wait(60), "the stream never started"
        busy = [n for n in c.decode_nodes() if n.proc.poll() is None and leased(n) > 0]
        assert len(busy) == 1, "the stream should hold pages on exactly one decode node"
        return t, events, busy[0]
    finally:
        canaries.paused.clear()


def test_faults_short(tmp_path):
    keys = tmp_path / "api-keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, k in TENANT_KEYS.items()))
    c = Cluster(
        ["--kv-pool-tokens", "8192", "--kv-scrub", "poison", "--api-keys", keys,
         "--handoff-timeout-secs", HANDOFF_TIMEOUT],
        tmp_path, api_key=TENANT_KEYS["alice"], prefill=1, decode=2,
        router_args=["--handoff-timeout-secs", HANDOFF_TIMEOUT],
    )
    stopped = []
    try:
        with Canaries(c) as canaries:
            wait_until(lambda: all(canaries.ok[t] > 0 for t in CANARIES), 120, "both tenants served")

            # 1. A hung decode node mid-stream.
            t, events, victim = busy_decode(c, canaries)
            victim.proc.send_signal(signal.SIGSTOP)
            stopped.append(victim)
            hung_at = time.monotonic()
            t.join(timeout=HUNG_BOUND)
            assert not t.is_alive(), f"the client of a hung decode node got nothing within {HUNG_BOUND}s"
            assert ("status", 200) in events
            assert ended_with_one_error_event(events), events[-3:]
            assert events[-1][1] - hung_at < HUNG_BOUND
            victim.proc.send_signal(signal.SIGCONT)
            stopped.remove(victim)

            # 2. A hung prefill node mid-prefill.
            prefill = c.prefill_nodes()[0]
            long_prompt = (GOLDEN[3]["prompt_tokens"] * 400)[:6000]
            result = {}

            def long_request():
                try:
                    result["r"] = requests.post(
                        c.url + "/v1/completions",
                        json={"model": MODEL_NAME, "prompt": long_prompt, "max_tokens": 4, "temperature": 0},
                        headers={"Authorization": f"Bearer {TENANT_KEYS['alice']}"}, timeout=HUNG_BOUND + 60,
                    )
                except requests.RequestException as e:
                    result["e"] = e

            lt = threading.Thread(target=long_request)
            lt.start()
            wait_until(lambda: leased(prefill) > 64, 60, "the long prefill started")
            prefill.proc.send_signal(signal.SIGSTOP)
            stopped.append(prefill)
            lt.join(timeout=HUNG_BOUND)
            assert not lt.is_alive(), f"the client of a hung prefill node got nothing within {HUNG_BOUND}s"
            assert "r" in result, result
            assert result["r"].status_code in (503, 504), result["r"].text
            assert result["r"].json()["error"]["code"] in FAULT_CODES, result["r"].text
            prefill.proc.send_signal(signal.SIGCONT)
            stopped.remove(prefill)

            # 3. A killed decode node, restarted on its address, is used again.
            t, events, victim = busy_decode(c, canaries)
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(timeout=30)
            t.join(timeout=HUNG_BOUND)
            assert not t.is_alive(), "the client of a killed decode node hung"
            assert ended_with_one_error_event(events), events[-3:]
            victim.restart()
            # No operator action: the router's poll finds it, and canary traffic reaches it.
            wait_until(lambda: victim.metrics().get("kvwarden_generation_tokens_total", 0) > 0, 120,
                       "the router sent the restarted decode node no request")
            before = dict(canaries.ok)
            wait_until(lambda: all(canaries.ok[t] > before[t] for t in CANARIES), 120,
                       "both tenants served after the faults")

            # 4. The router killed mid-stream, then restarted on its address.
            t, events, _ = busy_decode(c, canaries)
            canaries.router_down.set()
            c.proc.send_signal(signal.SIGKILL)
            c.proc.wait(timeout=30)
            t.join(timeout=HUNG_BOUND)
            assert not t.is_alive(), "the client of a killed router hung"
            data = [d for kind, d in events if kind == "data"]
            assert b"[DONE]" not in data, "a stream cut by the router's death looked complete"
            assert any(kind == "error" for kind, _ in events) or (data and "error" in json.loads(data[-1])), events[-3:]
            # The nodes release what the dead router's requests held.
            wait_until(lambda: all(leased(n) == 0 for n in c.nodes), 60,
                       "nodes released the dead router's requests")
            c.restart_router()
            canaries.router_down.clear()
            before = dict(canaries.ok)
            wait_until(lambda: all(canaries.ok[t] > before[t] for t in CANARIES), 120,
                       "both tenants served by the restarted router")

        assert canaries.leaks == [], canaries.leaks[:3]
        assert canaries.wrong == [], canaries.wrong[:3]
        # Quiescence: every node, the restarted one too, back to no leased page.
        wait_until(lambda: all(leased(n) == 0 for n in c.nodes), 60, "pages back to idle on every node")
        for n in c.nodes:
            m = n.metrics()
            pages = {s: m[f'kvwarden_kv_pages{{state="{s}"}}'] for s in ("total", "free", "leased", "cached")}
            # Nothing unaccounted: every page is free or cached, none leased.
            assert pages["leased"] == 0 and pages["free"] + pages["cached"] == pages["total"], (n.role, pages)
        # The survivors answer correctly afterwards.
        case = GOLDEN[2]
        r = c.post("/v1/completions", {"model": MODEL_NAME, "prompt": case["prompt_tokens"],
                                       "max_tokens": len(case["completion_tokens"]), "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == own_greedy(case["prompt_tokens"], len(case["completion_tokens"]))
        print(f"\nfaults: 2 SIGSTOP, 2 SIGKILL + restart; canaries ok {canaries.ok}, "
              f"errors {canaries.errors}, unreachable while the router was down {canaries.unreachable}, "
              f"leaks {len(canaries.leaks)}, wrong {len(canaries.wrong)}")
    finally:
        for n in stopped:
            n.proc.send_signal(signal.SIGCONT)
        c.stop()
