"""A router that finds its nodes by DNS (`--prefill dns:NAME:PORT --decode dns:NAME:PORT`,
as a Kubernetes headless Service answers): with a DNS server this test runs (dnslib) and
changes, a router started before its decode pool has any record waits for one, a decode
node added to the records while requests flow receives requests with no
router restart (one that cannot hold the advertised context is kept out), and a node taken
out of them is drained: the requests it holds end with the right answer, nothing new
reaches it, and its pages all come back.

Every node listens on its own loopback address (127.0.0.2 to .5) so that, as in a
Service, one port serves the whole pool and the records name addresses only."""

import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from conftest import BIN, MODEL, MODEL_NAME, ROOT, Node, make_certs, require_binary, wait_for_line

PREFILL_NAME = "prefill.kvwarden.test."
DECODE_NAME = "decode.kvwarden.test."
PROMPTS = ["Name the capital of France.", "Count from one to ten:", "Say hello.", "Name three colours."]


class Records(BaseResolver):
    """A records the test changes while the router asks."""

    def __init__(self):
        self.lock = threading.Lock()
        self.a = {}

    def set(self, name, ips):
        with self.lock:
            self.a[name] = list(ips)

    def resolve(self, request, handler):
        reply = request.reply()
        with self.lock:
            ips = self.a.get(str(request.q.qname))
        if ips is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype == QTYPE.A:
            for ip in ips:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(ip), ttl=1))
        return reply


def free_port(host, kind=socket.SOCK_STREAM):
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pool_port(*hosts):
    """A TCP port free on every one of `hosts`."""
    for _ in range(50):
        port = free_port(hosts[0])
        try:
            for h in hosts[1:]:
                with socket.socket() as s:
                    s.bind((h, port))
            return port
        except OSError:
            continue
    pytest.fail(f"no port free on all of {hosts}")


def router_metrics(url):
    out = {}
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def node_requests(url, addr):
    return router_metrics(url).get(
        f'kvwarden_router_node_requests_total{{role="decode",node="{addr}"}}')


def ask(url, prompt):
    r = requests.post(url + "/v1/completions", json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0,
    }, timeout=120)
    return r.status_code, (r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)


def wait_until(what, check, timeout=30):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def dns():
    records = Records()
    port = free_port("127.0.0.1", socket.SOCK_DGRAM)
    server = DNSServer(records, port=port, address="127.0.0.1",
                       logger=DNSLogger("-request,-reply,-truncated,-error,-recv,-send,-data"))
    server.start_thread()
    yield records, port
    server.stop()


def test_nodes_join_and_leave_a_pool_by_dns_under_load(dns, tmp_path):
    require_binary()
    records, dns_port = dns
    certs = make_certs(tmp_path / "certs", ["router", "prefill0", "decode0", "decode1", "decode2"])
    prefill_port = pool_port("127.0.0.2")
    decode_port = pool_port("127.0.0.3", "127.0.0.4", "127.0.0.5")
    args = ["--kv-pool-tokens", "2048", "--kv-scrub", "poison"]
    nodes = [
        Node("prefill", [*args, "--host", "127.0.0.2"], certs, "prefill0", tmp_path / "prefill0.log",
             port=prefill_port),
        Node("decode", [*args, "--host", "127.0.0.3"], certs, "decode0", tmp_path / "decode0.log",
             port=decode_port),
        Node("decode", [*args, "--host", "127.0.0.4"], certs, "decode1", tmp_path / "decode1.log",
             port=decode_port),
        # Its pool holds 256 tokens: less than the 2,048 the router advertises.
        Node("decode", ["--kv-pool-tokens", "256", "--host", "127.0.0.5"], certs, "decode2",
             tmp_path / "decode2.log", port=decode_port),
    ]
    first, second, small = (f"127.0.0.{i}:{decode_port}" for i in (3, 4, 5))
    records.set(PREFILL_NAME, ["127.0.0.2"])
    log_path = tmp_path / "router.log"
    log = open(log_path, "wb")
    router = subprocess.Popen([
        str(BIN), "router", "--model", str(MODEL), "--port", "0", "--served-model-name", MODEL_NAME,
        "--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "router.pem"),
        "--tls-key", str(certs / "router.key"),
        "--prefill", f"dns:{PREFILL_NAME.rstrip('.')}:{prefill_port}",
        "--decode", f"dns:{DECODE_NAME.rstrip('.')}:{decode_port}",
        "--dns-server", f"127.0.0.1:{dns_port}", "--dns-interval", "1",
    ], stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT)
    stop = threading.Event()
    try:
        # No decode record yet (pods still starting): the router waits, it does not exit.
        time.sleep(2.5)
        assert router.poll() is None, log_path.read_text(errors="replace")
        assert "listening" not in log_path.read_text(errors="replace")
        records.set(DECODE_NAME, ["127.0.0.3"])
        url = wait_for_line(router, log_path, r"listening on (http://[0-9.]+:\d+)", "kvwarden router")
        expected = {p: ask(url, p) for p in PROMPTS}
        assert all(status == 200 for status, _ in expected.values()), expected
        assert node_requests(url, second) is None, "a node outside the records was used"

        answers = []

        def load(k):
            while not stop.is_set():
                p = PROMPTS[k % len(PROMPTS)]
                answers.append((p, ask(url, p)))
                k += 1

        with ThreadPoolExecutor(4) as pool:
            for k in range(4):
                pool.submit(load, k)
            # A node added to the records receives requests, with no restart.
            records.set(DECODE_NAME, ["127.0.0.3", "127.0.0.4", "127.0.0.5"])
            wait_until("the new decode node to be used", lambda: (node_requests(url, second) or 0) >= 3)
            # A node taken out of them is drained: nothing new reaches it.
            records.set(DECODE_NAME, ["127.0.0.4", "127.0.0.5"])
            wait_until("the old decode node to leave the router",
                       lambda: node_requests(url, first) is None)
            # Its requests end there; from then on it computes nothing.
            wait_until("the drained node's requests to end",
                       lambda: nodes[1].metrics()["kvwarden_requests_running"] == 0)
            drained = nodes[1].metrics()["kvwarden_generation_tokens_total"]
            before = node_requests(url, second)
            wait_until("more requests on the remaining node", lambda: node_requests(url, second) >= before + 4)
            stop.set()
        assert nodes[1].metrics()["kvwarden_generation_tokens_total"] == drained, \
            "a drained node was given new work"
        assert len(answers) >= 8, len(answers)
        m = router_metrics(url)
        assert m[f'kvwarden_router_node_up{{role="decode",node="{small}"}}'] == 0
        assert node_requests(url, small) == 0, "a node that cannot hold the context was used"
        assert "kept out" in log_path.read_text(errors="replace")
        for p, got in answers:
            assert got == expected[p], (p, got)
        for n in nodes[1:]:
            wait_until("every page back", lambda n=n: n.metrics()['kvwarden_kv_pages{state="leased"}'] == 0)
        assert router.poll() is None, "the router exited"
    finally:
        stop.set()
        router.terminate()
        try:
            router.wait(timeout=15)
        except subprocess.TimeoutExpired:
            router.kill()
        log.close()
        for n in nodes:
            n.stop()
