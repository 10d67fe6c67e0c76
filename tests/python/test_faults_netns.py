"""Fault suite, long form: prefill and decode as separate hosts (issue 10). Each node runs
in a network namespace of its own, created here (as root); the router runs on the host
and reaches them over one veth pair each, and the K/V transfer has its own veth pair
between the two namespaces, so it can be cut or degraded while the router still reaches
both nodes:

    host (router) --veth-- [prefill ns] ==veth (transfer)== [decode ns] --veth-- host

1. The transfer link is slowed, a long prompt's push starts, and the link is cut (`ip link
   set down`) mid-transfer: that client gets 502/503/504 in OpenAI's shape, never a 200.
2. While it is down, canary traffic gets only fault statuses.
3. The link comes back degraded: this kernel has no `netem`, so a token bucket (`tc tbf`)
   stands in for delay and loss: a slow link whose queue drops what exceeds its latency
   bound, which TCP sees as delay and loss.
4. The link is restored: the router's requests get through again (the path is used again).
5. The decode node is killed (SIGKILL) mid-transfer: that client gets 502/503/504; the
   node, restarted in its namespace on its address, is used again.
6. The decode node hangs (SIGSTOP) mid-transfer: that client gets a fault status within the
   bound; resumed (SIGCONT), the node serves again.

Throughout, canaries of two tenants: zero leaks, only fault statuses; at the end both nodes
hold no leased page. Namespaces that cannot be created fail the test (it needs root).
"""

import os
import signal
import subprocess
import threading
import time

import pytest
import requests

from conftest import BIN, MODEL, MODEL_NAME, ROOT, TENANT_KEYS, Node, Server, make_certs, wait_for_line
from test_faults import CANARIES, FAULT_CODES, Canaries, leased, wait_until

HANDOFF_TIMEOUT = 20
# A cut link costs its client an error within the handoff timeout plus detection slack.
CUT_BOUND = 90
TAG = os.getpid() % 10000
NET = 200 + (os.getpid() % 50)


def sh(*cmd):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"`{' '.join(map(str, cmd))}` failed ({r.returncode}): {r.stderr.strip()}", pytrace=False)
    return r.stdout


class Net:
    """Two namespaces and three veth pairs; `close()` removes them all."""

    def __init__(self):
        self.p, self.d = f"kvwp{TAG}", f"kvwd{TAG}"
        self.host_p, self.host_d = f"10.{NET}.1.1", f"10.{NET}.2.1"
        self.prefill_ip, self.decode_ip = f"10.{NET}.1.2", f"10.{NET}.2.2"
        # The transfer link's two ends: in the prefill and the decode namespace.
        self.link_p, self.link_d = f"kpd{TAG}", f"kdp{TAG}"
        self.veths = [f"khp{TAG}", f"khd{TAG}"]
        self.made = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self):
        for ns in (self.p, self.d):
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        for host_end, ns, host_ip, ns_ip in ((self.veths[0], self.p, self.host_p, self.prefill_ip),
                                             (self.veths[1], self.d, self.host_d, self.decode_ip)):
            sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", host_end + "n")
            sh("ip", "link", "set", host_end + "n", "netns", ns)
            sh("ip", "addr", "add", host_ip + "/24", "dev", host_end)
            sh("ip", "link", "set", host_end, "up")
            sh("ip", "-n", ns, "addr", "add", ns_ip + "/24", "dev", host_end + "n")
            sh("ip", "-n", ns, "link", "set", host_end + "n", "up")
        sh("ip", "link", "add", self.link_p, "type", "veth", "peer", "name", self.link_d)
        sh("ip", "link", "set", self.link_p, "netns", self.p)
        sh("ip", "link", "set", self.link_d, "netns", self.d)
        sh("ip", "-n", self.p, "addr", "add", f"10.{NET}.3.1/24", "dev", self.link_p)
        sh("ip", "-n", self.d, "addr", "add", f"10.{NET}.3.2/24", "dev", self.link_d)
        self.link("up")

    def link(self, state):
        sh("ip", "-n", self.p, "link", "set", self.link_p, state)
        sh("ip", "-n", self.d, "link", "set", self.link_d, state)
        if state == "up":
            # The prefill node pushes to the decode node's address (the one the router
            # knows) over the transfer link, not through the host; a link that went down
            # took this route with it.
            sh("ip", "-n", self.p, "route", "replace", self.decode_ip + "/32", "via", f"10.{NET}.3.2",
               "dev", self.link_p)

    def shape(self, *tbf):
        """Degrades both directions of the transfer link with a token bucket, or (no
        arguments) restores it."""
        for ns, dev in ((self.p, self.link_p), (self.d, self.link_d)):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True)
            if tbf:
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", *tbf)

    def close(self):
        for v in self.veths:
            subprocess.run(["ip", "link", "del", v], capture_output=True)
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class NsNode(Node):
    """A node whose process runs inside a network namespace (`ip netns exec` execs it, so
    the pid is the node's own)."""

    def __init__(self, netns, *args, **kw):
        self.netns = netns
        super().__init__(*args, **kw)

    def _start(self, cmd, log_path):
        super()._start(["ip", "netns", "exec", self.netns, *cmd], log_path)


class Router(Server):
    def __init__(self, certs, nodes, log_path, args):
        self.log_path = log_path
        self.log = open(log_path, "wb")
        cmd = [
            str(BIN), "router", "--model", str(MODEL), "--port", "0", "--served-model-name", MODEL_NAME,
            "--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "router.pem"),
            "--tls-key", str(certs / "router.key"),
            *[a for n in nodes for a in (f"--{n.role}", n.addr)], *[str(a) for a in args],
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, cwd=ROOT)
        self.url = wait_for_line(self.proc, log_path, r"listening on (http://[0-9.]+:\d+)", "kvwarden router")
        self._wait_healthy()
        self.api_key = TENANT_KEYS["alice"]
        self.nodes = nodes


def post_long(router, prompt, out):
    try:
        out["r"] = requests.post(
            router.url + "/v1/completions",
            json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0},
            headers={"Authorization": f"Bearer {TENANT_KEYS['alice']}"}, timeout=CUT_BOUND + 60,
        )
    except requests.RequestException as e:
        out["e"] = e


def assert_fault_status(r):
    assert r.status_code in (502, 503, 504), r.text
    err = r.json()["error"]
    assert err["code"] in FAULT_CODES and err["message"], err


def test_transfer_link_cut_and_degraded(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("network namespaces need root (ip netns add)", pytrace=False)
    net = Net()
    certs = make_certs(tmp_path / "certs", ["router", "prefill0", "decode0"])
    keys = tmp_path / "api-keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, k in TENANT_KEYS.items()))
    node_args = ["--kv-pool-tokens", "8192", "--kv-scrub", "poison", "--handoff-timeout-secs", HANDOFF_TIMEOUT]
    nodes, router = [], None
    try:
        nodes.append(NsNode(net.p, "prefill", [*node_args, "--host", net.prefill_ip], certs, "prefill0",
                            tmp_path / "prefill0.log"))
        nodes.append(NsNode(net.d, "decode", [*node_args, "--host", net.decode_ip], certs, "decode0",
                            tmp_path / "decode0.log"))
        prefill, decode = nodes
        router = Router(certs, nodes, tmp_path / "router.log",
                        ["--api-keys", keys, "--handoff-timeout-secs", HANDOFF_TIMEOUT])
        with Canaries(router) as canaries:
            wait_until(lambda: all(canaries.ok[t] > 0 for t in CANARIES), 120, "both tenants served")

            # 1. Cut mid-transfer: slow the link so that a long prompt's push takes seconds,
            # wait until its prefill is done (the push has begun), and cut.
            canaries.paused.set()
            wait_until(lambda: leased(decode) == 0 and leased(prefill) == 0, 60, "canaries drained")
            net.shape("rate", "16mbit", "burst", "64kb", "latency", "2s")
            pushed = decode.metrics()["kvwarden_transfers_total"]
            long_prompt = "Summarize: " + " ".join(f"line {i} of the report is fine." for i in range(90))
            out = {}
            t = threading.Thread(target=post_long, args=(router, long_prompt, out))
            t.start()
            # The prefill node holds leased pages while it computes, and lets them go when
            # it hands the K/V to the push.
            wait_until(lambda: leased(prefill) > 0, 60, "the long prompt's prefill started")
            wait_until(lambda: leased(prefill) == 0, 120, "the long prompt's prefill finished")
            assert decode.metrics()["kvwarden_transfers_total"] == pushed, "the push ended before the cut"
            net.link("down")
            cut_at = time.monotonic()
            t.join(timeout=CUT_BOUND)
            assert not t.is_alive(), f"the client of a cut transfer got nothing within {CUT_BOUND}s"
            assert "r" in out, out
            assert_fault_status(out["r"])
            assert time.monotonic() - cut_at < CUT_BOUND
            cut_status = (out["r"].status_code, out["r"].json()["error"]["code"])

            # 2. While the link is down, canaries get only fault statuses (checked by them).
            failed_before = sum(canaries.errors.values())
            canaries.paused.clear()
            wait_until(lambda: sum(canaries.errors.values()) > failed_before, CUT_BOUND,
                       "canaries saw the cut link")

            # 3. Back up, degraded: slow, and dropping what queues beyond 50 ms.
            net.link("up")
            net.shape("rate", "4mbit", "burst", "16kb", "latency", "50ms")
            before = dict(canaries.ok)
            wait_until(lambda: all(canaries.ok[t] > before[t] for t in CANARIES), 240,
                       "both tenants served over a degraded link")

            # 4. Restored: the path is used again, at full speed.
            net.shape()
            before = dict(canaries.ok)
            wait_until(lambda: all(canaries.ok[t] > before[t] + 1 for t in CANARIES), 120,
                       "both tenants served after the link was restored")

            # 5. The decode node killed mid-transfer, then restarted on its address.
            canaries.paused.set()
            wait_until(lambda: leased(decode) == 0 and leased(prefill) == 0, 60, "canaries drained")
            net.shape("rate", "16mbit", "burst", "64kb", "latency", "2s")
            out = {}
            t = threading.Thread(target=post_long, args=(router, "Second report. " + long_prompt, out))
            t.start()
            wait_until(lambda: leased(prefill) > 0, 60, "the second long prefill started")
            wait_until(lambda: leased(prefill) == 0, 120, "the second long prefill finished")
            decode.proc.send_signal(signal.SIGKILL)
            decode.proc.wait(timeout=30)
            t.join(timeout=CUT_BOUND)
            assert not t.is_alive(), "the client of a transfer to a killed node hung"
            assert "r" in out, out
            assert_fault_status(out["r"])
            kill_status = (out["r"].status_code, out["r"].json()["error"]["code"])
            net.shape()
            decode.restart()
            canaries.paused.clear()
            before = dict(canaries.ok)
            wait_until(lambda: all(canaries.ok[t] > before[t] for t in CANARIES), 120,
                       "the router used the restarted decode node")

            # 6. The decode node hung (SIGSTOP) mid-transfer, then resumed: that client gets
            # a fault status within the bound, and the resumed node serves again.
            canaries.paused.set()
            wait_until(lambda: leased(decode) == 0 and leased(prefill) == 0, 60, "canaries drained")
            net.shape("rate", "16mbit", "burst", "64kb", "latency", "2s")
            out = {}
            t = threading.Thread(target=post_long, args=(router, "Third report. " + long_prompt, out))
            t.start()
            wait_until(lambda: leased(prefill) > 0, 60, "the third long prefill started")
            wait_until(lambda: leased(prefill) == 0, 120, "the third long prefill finished")
            decode.proc.send_signal(signal.SIGSTOP)
            t.join(timeout=CUT_BOUND)
            decode.proc.send_signal(signal.SIGCONT)
            assert not t.is_alive(), "the client of a transfer to a hung node hung"
            assert "r" in out, out
            assert_fault_status(out["r"])
            stop_status = (out["r"].status_code, out["r"].json()["error"]["code"])
            net.shape()
            canaries.paused.clear()
            before = dict(canaries.ok)
            wait_until(lambda: all(canaries.ok[t] > before[t] for t in CANARIES), 120,
                       "both tenants served after the hung decode node resumed")

        assert canaries.leaks == [], canaries.leaks[:3]
        assert canaries.wrong == [], canaries.wrong[:3]
        # Quiescence: no page leased on either node, every page free or cached.
        wait_until(lambda: all(leased(n) == 0 for n in nodes), HANDOFF_TIMEOUT + 60,
                   "pages back to idle on both nodes")
        for n in nodes:
            m = n.metrics()
            pages = {s: m[f'kvwarden_kv_pages{{state="{s}"}}'] for s in ("total", "free", "leased", "cached")}
            assert pages["leased"] == 0 and pages["free"] + pages["cached"] == pages["total"], (n.role, pages)
        print(f"\nnetns faults: transfer link cut mid-push, down, degraded (tbf), restored; decode "
              f"SIGKILL mid-push and restart, SIGSTOP mid-push; cut push answered {cut_status}, killed "
              f"push {kill_status}, hung push {stop_status}; "
              f"canaries ok {canaries.ok}, errors {canaries.errors}, leaks {len(canaries.leaks)}, "
              f"wrong {len(canaries.wrong)}")
    finally:
        if router is not None:
            router.stop()
        for n in nodes:
            n.proc.send_signal(signal.SIGCONT)
            n.stop()
        net.close()
