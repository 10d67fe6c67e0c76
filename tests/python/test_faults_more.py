"""Fault suite, long form: the kill points and client behaviours that test_faults.py and
test_edge.py do not cover (issue 10):

1. SIGSTOP of the router mid-stream (a hung router): the nodes' keepalive drops its calls,
   so they release the stream's pages while it is stopped; after SIGCONT the client's
   stream ends (complete and correct, or with one error event, never a wrong answer) and
   the router serves again.
2. SIGKILL of the prefill node before any request reaches it: requests get 503 in OpenAI's
   shape (no node to admit them), never a hang; restarted on its address, it is used again
   without operator action. Then SIGSTOP of it before admission (a hung node): requests end
   with a fault status after the handoff timeout, no decode node holds pages for them, and
   resumed (SIGCONT) it serves again. And SIGKILL of it mid-prefill: that client gets a fault
   status, no decode node holds pages for it, and the restarted node is used again.
3. 1,000 idle keep-alive connections on the router: a normal client is still served, and
   the header timeout closes every idle one.

Pass/fail never depends on timings beyond liveness bounds.
"""

import json
import resource
import signal
import socket
import threading
import time

import requests

from conftest import MODEL_NAME, TENANT_KEYS, Cluster, own_greedy
from test_faults import GOLDEN, ended_with_one_error_event, leased, stream, wait_until

ALICE = TENANT_KEYS["alice"]


def keys_file(tmp_path):
    keys = tmp_path / "api-keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, k in TENANT_KEYS.items()))
    return keys


def golden_ok(c):
    case = GOLDEN[2]
    r = c.post("/v1/completions", {"model": MODEL_NAME, "prompt": case["prompt_tokens"],
                                   "max_tokens": len(case["completion_tokens"]), "temperature": 0})
    return r.status_code == 200 and r.json()["choices"][0]["text"] == own_greedy(case["prompt_tokens"], len(case["completion_tokens"]))


def test_a_stopped_router_and_a_prefill_node_killed_before_admission(tmp_path):
    c = Cluster(
        ["--kv-pool-tokens", "8192", "--kv-scrub", "poison", "--api-keys", keys_file(tmp_path),
         "--handoff-timeout-secs", 5],
        tmp_path, api_key=ALICE, router_args=["--handoff-timeout-secs", 5],
    )
    stopped = False
    hung = None
    try:
        assert golden_ok(c)
        # 1. The router hung mid-stream.
        events, started = [], threading.Event()
        t = threading.Thread(target=stream, args=(c, GOLDEN[1]["prompt_tokens"], 3000, events, started))
        t.start()
        assert started.wait(60), "the stream never started"
        assert any(leased(n) > 0 for n in c.decode_nodes())
        c.proc.send_signal(signal.SIGSTOP)
        stopped = True
        wait_until(lambda: all(leased(n) == 0 for n in c.nodes), 60,
                   "nodes released a hung router's stream")
        c.proc.send_signal(signal.SIGCONT)
        stopped = False
        t.join(timeout=120)
        assert not t.is_alive(), "the client of a router that was hung never saw its stream end"
        data = [d for kind, d in events if kind == "data"]
        complete = data and data[-1] == b"[DONE]" and not any(
            "error" in json.loads(d) for d in data if d != b"[DONE]")
        assert complete or ended_with_one_error_event(events) or any(k == "error" for k, _ in events), events[-3:]
        if complete:
            text = "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1] if json.loads(d)["choices"])
            assert len(text) > 0
        wait_until(lambda: golden_ok(c), 60, "the router served again after SIGCONT")

        # 2. The prefill node killed before any request reaches it.
        prefill = c.prefill_nodes()[0]
        prefill.proc.send_signal(signal.SIGKILL)
        prefill.proc.wait(timeout=30)
        statuses = set()
        for _ in range(5):
            r = c.post("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
            statuses.add(r.status_code)
            assert r.status_code in (502, 503), r.text
            assert r.json()["error"]["code"] in ("service_unavailable", "kv_handoff_failed"), r.text
        assert all(leased(n) == 0 for n in c.decode_nodes()), "a decode node held pages for a request no prefill node admitted"
        prefill.restart()
        wait_until(lambda: golden_ok(c), 120, "the router used the restarted prefill node")
        assert all(leased(n) == 0 for n in c.nodes)

        # 3. The prefill node killed mid-prefill (a long prompt under way): that client gets
        # a fault status; the node, restarted, is used again.
        prefill = c.prefill_nodes()[0]
        long_prompt = (GOLDEN[3]["prompt_tokens"] * 400)[:6000]
        result = {}

        def long_request():
            try:
                result["r"] = requests.post(
                    c.url + "/v1/completions",
                    json={"model": MODEL_NAME, "prompt": long_prompt, "max_tokens": 4, "temperature": 0},
                    headers={"Authorization": f"Bearer {ALICE}"}, timeout=120,
                )
            except requests.RequestException as e:
                result["e"] = e

        lt = threading.Thread(target=long_request)
        lt.start()
        wait_until(lambda: leased(prefill) > 64, 60, "the long prefill started")
        prefill.proc.send_signal(signal.SIGKILL)
        prefill.proc.wait(timeout=30)
        lt.join(timeout=120)
        assert not lt.is_alive(), "the client of a prefill node killed mid-prefill hung"
        assert "r" in result, result
        assert result["r"].status_code in (502, 503, 504), result["r"].text
        killed_status = result["r"].status_code
        assert all(leased(n) == 0 for n in c.decode_nodes()), "a decode node held pages for a prefill that died"
        prefill.restart()
        wait_until(lambda: golden_ok(c), 120, "the router used the prefill node restarted after a mid-prefill kill")

        # 4. The prefill node hung (SIGSTOP) before any request reaches it: its admission
        # answers nothing, so the router's handoff timeout ends each request with a fault
        # status; resumed, the node serves again.
        prefill = c.prefill_nodes()[0]
        prefill.proc.send_signal(signal.SIGSTOP)
        hung = prefill
        hung_statuses = set()
        for _ in range(2):
            r = c.post("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
            hung_statuses.add(r.status_code)
            assert r.status_code in (502, 503, 504), r.text
            assert r.json()["error"]["code"] in (
                "service_unavailable", "kv_handoff_failed", "upstream_timeout"), r.text
        assert all(leased(n) == 0 for n in c.decode_nodes()), "a decode node held pages for a request a hung prefill node never admitted"
        prefill.proc.send_signal(signal.SIGCONT)
        hung = None
        wait_until(lambda: golden_ok(c), 120, "the router used the resumed prefill node")
        wait_until(lambda: all(leased(n) == 0 for n in c.nodes), 60, "pages back to idle")
        print(f"\nmore faults: router SIGSTOP mid-stream, prefill SIGKILL before admission "
              f"(statuses {sorted(statuses)}), restarted and used again; prefill SIGSTOP before "
              f"admission (statuses {sorted(hung_statuses)}), resumed and used again; prefill SIGKILL "
              f"mid-prefill ({killed_status}), restarted and used again")
    finally:
        if stopped:
            c.proc.send_signal(signal.SIGCONT)
        if hung is not None:
            hung.proc.send_signal(signal.SIGCONT)
        c.stop()


IDLE = 1000


def test_a_thousand_idle_keep_alive_connections(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < IDLE + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    c = Cluster(
        ["--kv-pool-tokens", "4096", "--max-connections", IDLE + 50,
         "--max-connections-per-address", IDLE + 50, "--header-timeout", "5"],
        tmp_path, nofile=8192,
    )
    socks = []
    try:
        host, port = c.url.rsplit("//", 1)[1].split(":")
        for _ in range(IDLE):
            s = socket.create_connection((host, int(port)), timeout=30)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            socks.append(s)
        answered = 0
        for s in socks:
            reply = s.recv(4096)
            answered += reply.startswith(b"HTTP/1.1 200")
        assert answered == IDLE
        # All of them idle on keep-alive: a normal client is served.
        assert golden_ok(c)
        # The header timeout (also the keep-alive limit) closes every idle connection.
        deadline = time.monotonic() + 60
        closed = 0
        for s in socks:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                closed += s.recv(4096) == b""
            except ConnectionResetError:
                closed += 1
            except socket.timeout:
                pass
        assert closed == IDLE, f"{IDLE - closed} idle connections were never closed"
        assert golden_ok(c)
        print(f"\nmore faults: {IDLE} idle keep-alive connections answered, then closed; golden answer still exact")
    finally:
        for s in socks:
            s.close()
        c.stop()
