"""The disaggregated mode end to end: `kvwarden router` over prefill and decode processes on
loopback, over mutual TLS. Content, not status codes: the router's answers are the
monolithic server's token for token, an over-length request never reaches a decode node,
and a killed node costs its own requests an error, never a 200 with partial or foreign
content.

(The rest of the suite also runs against a router: `KVWARDEN_DEPLOYMENT=cluster`.)
"""

import json
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from conftest import BIN, MODEL, MODEL_NAME, ROOT, Cluster, Node, Server, make_certs, own_greedy

GOLDEN = json.loads((ROOT / "tests" / "data" / "golden" / "completions.json").read_text())["cases"]


def complete_ids(server, prompt_tokens, max_tokens, **kw):
    """Completion text, per-token logprobs, and the finish reason, for a token-id prompt."""
    r = server.post(
        "/v1/completions",
        {
            "model": MODEL_NAME,
            "prompt": prompt_tokens,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
            **kw,
        },
    )
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"], c["finish_reason"], r.json()["usage"]


@pytest.fixture(scope="module")
def mono(tmp_path_factory):
    s = Server(["--kv-pool-tokens", "4096"], tmp_path_factory.mktemp("mono") / "stderr.log")
    yield s
    s.stop()


@pytest.fixture(scope="module", params=[(1, 1), (2, 2)], ids=["1+1", "2+2"])
def cluster(request, tmp_path_factory):
    p, d = request.param
    c = Cluster(
        ["--kv-pool-tokens", "4096", "--kv-scrub", "poison"],
        tmp_path_factory.mktemp(f"cluster{p}{d}"),
        prefill=p,
        decode=d,
    )
    yield c
    c.stop()


def test_golden_completions_through_the_router(cluster, mono):
    """Every golden prompt: the router's text equals kvwarden's own greedy answer, and its
    tokens and logprob bits equal the monolithic server's."""
    for case in GOLDEN:
        n = len(case["completion_tokens"])
        got = complete_ids(cluster, case["prompt_tokens"], n)
        want = complete_ids(mono, case["prompt_tokens"], n)
        assert got[0] == own_greedy(case["prompt_tokens"], n), case["prompt"]
        # Same tokens, same logprob bits, same finish reason and token counts (what the
        # prefix caches served may differ with the history of each).
        counts = lambda u: (u["prompt_tokens"], u["completion_tokens"])  # noqa: E731
        assert got[:3] == want[:3], case["prompt"]
        assert counts(got[3]) == counts(want[3]), case["prompt"]


def test_golden_completions_concurrently(cluster):
    """All cases at once, spread over the nodes: each answer is its solo answer."""
    def run(case):
        return complete_ids(cluster, case["prompt_tokens"], len(case["completion_tokens"]))[0]

    with ThreadPoolExecutor(max_workers=len(GOLDEN)) as pool:
        texts = list(pool.map(run, GOLDEN))
    for case, text in zip(GOLDEN, texts):
        assert text == own_greedy(case["prompt_tokens"], len(case["completion_tokens"])), case["prompt"]
    m = cluster.metrics()
    assert m["kvwarden_isolation_check_failures_total"] == 0
    assert m["kvwarden_router_handoffs_total"] >= 2 * len(GOLDEN)
    if len(cluster.decode_nodes()) > 1:
        used = [n.metrics()["kvwarden_node_decode_requests_total"] for n in cluster.decode_nodes()]
        assert all(u > 0 for u in used), f"a decode node took no request: {used}"


def test_kv_bytes_moved_per_prompt_token(cluster):
    before = cluster.metrics()['kvwarden_transfer_bytes_total{direction="received"}']
    prompt = GOLDEN[0]["prompt_tokens"] * 20
    complete_ids(cluster, prompt, 2)
    moved = cluster.metrics()['kvwarden_transfer_bytes_total{direction="received"}'] - before
    # 30 layers x (K + V) x 192 values x 2 bytes (f16) per token.
    assert moved == len(prompt) * 30 * 2 * 192 * 2


def decode_requests(cluster):
    return sum(n.metrics()["kvwarden_node_decode_requests_total"] for n in cluster.decode_nodes())


def test_over_length_never_reaches_a_decode_node(tmp_path):
    """Pools of 256 (prefill) and 128 (decode) tokens: the router advertises the smaller;
    at limit - 1 the request succeeds, at the limit and above it is refused with 400 and no
    decode node hears of it."""
    c = Cluster(
        [], tmp_path, prefill_args=["--kv-pool-tokens", "256"], decode_args=["--kv-pool-tokens", "128"]
    )
    try:
        models = c.client.models.list()
        assert models.data[0].model_extra["max_model_len"] == 128
        base = decode_requests(c)
        ok = c.post("/v1/completions", {"model": MODEL_NAME, "prompt": [504] * 127, "max_tokens": 1})
        assert ok.status_code == 200, ok.text
        assert decode_requests(c) == base + 1
        for n in (128, 129, 1000):
            r = c.post("/v1/completions", {"model": MODEL_NAME, "prompt": [504] * n, "max_tokens": 1})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "context_length_exceeded"
            assert "128" in r.json()["error"]["message"]
        assert decode_requests(c) == base + 1, "a rejected request reached a decode node"
    finally:
        c.stop()


def router_refusal(certs: Path, nodes, *args) -> str:
    """`kvwarden router` over `nodes` (a prefill and a decode node) with `certs`' router
    identity: asserts it refuses to start, and returns what it printed."""
    r = subprocess.run(
        [
            str(BIN), "router", "--model", str(MODEL), "--port", "0",
            "--prefill", nodes[0].addr, "--decode", nodes[1].addr,
            "--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "router.pem"),
            "--tls-key", str(certs / "router.key"), *args,
        ],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert r.returncode != 0 and "listening" not in r.stderr, r.stderr
    return r.stderr


def test_router_refuses_to_advertise_more_than_a_node_holds(tmp_path):
    certs = make_certs(tmp_path / "certs", ["router", "prefill0", "decode0"])
    nodes = [
        Node("prefill", ["--kv-pool-tokens", "512"], certs, "prefill0", tmp_path / "p.log"),
        Node("decode", ["--kv-pool-tokens", "256"], certs, "decode0", tmp_path / "d.log"),
    ]
    try:
        err = router_refusal(certs, nodes, "--max-context", "300")
        assert "300" in err and "256" in err, err
    finally:
        for n in nodes:
            n.stop()


def test_router_refuses_a_node_outside_the_cluster_ca(tmp_path):
    certs = make_certs(tmp_path / "certs", ["router", "prefill0", "decode0"])
    other = make_certs(tmp_path / "other", ["router"])
    nodes = [
        Node("prefill", ["--kv-pool-tokens", "256"], certs, "prefill0", tmp_path / "p.log"),
        Node("decode", ["--kv-pool-tokens", "256"], certs, "decode0", tmp_path / "d.log"),
    ]
    try:
        err = router_refusal(other, nodes)
        assert "not reachable" in err, err
        m = nodes[0].metrics()
        assert m['kvwarden_transfer_failures_total{reason="auth"}'] >= 1
    finally:
        for n in nodes:
            n.stop()


def stream_events(cluster, prompt_tokens, max_tokens, out: list, started: threading.Event):
    """Collects a streamed completion's data events; sets `started` at the first token."""
    try:
        r = cluster.post(
            "/v1/completions",
            {
                "model": MODEL_NAME, "prompt": prompt_tokens, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
            },
            stream=True,
        )
        out.append(("status", r.status_code))
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                out.append(("data", line[6:]))
                started.set()
    except requests.RequestException as e:
        out.append(("error", str(e)))
    finally:
        started.set()


def ended_with_error(events) -> bool:
    data = [d for kind, d in events if kind == "data"]
    if any(kind == "error" for kind, _ in events):
        return True
    return bool(data) and b"[DONE]" not in data and "error" in json.loads(data[-1])


def wait_idle(nodes, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(n.metrics()['kvwarden_kv_pages{state="leased"}'] == 0 for n in nodes):
            return True
        time.sleep(0.1)
    return False


def test_killing_a_decode_node_mid_stream(tmp_path, mono):
    """One prefill, two decode nodes: the client on the killed node gets one error event
    (no [DONE], no 200 that looks complete); the client on the other node gets its full,
    correct answer; the survivors hold no page afterwards."""
    c = Cluster(["--kv-pool-tokens", "4096"], tmp_path, prefill=1, decode=2)
    try:
        victim_events, started = [], threading.Event()
        victim = threading.Thread(
            target=stream_events, args=(c, GOLDEN[1]["prompt_tokens"], 3000, victim_events, started)
        )
        victim.start()
        assert started.wait(60), "the stream never started"
        busy = [n for n in c.decode_nodes() if n.metrics()['kvwarden_kv_pages{state="leased"}'] > 0]
        assert len(busy) == 1, "the streaming request should hold pages on exactly one decode node"
        survivor_case = GOLDEN[2]
        n = len(survivor_case["completion_tokens"])
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(complete_ids, c, survivor_case["prompt_tokens"], n)
            time.sleep(0.5)
            busy[0].proc.send_signal(signal.SIGKILL)
            # Reaped before anything asks which nodes live: a killed process closes its
            # sockets before it becomes a zombie, so poll() alone can still call it alive.
            busy[0].proc.wait(timeout=30)
            text = other.result(timeout=120)[0]
        victim.join(timeout=60)
        assert not victim.is_alive(), "the victim's client hung"
        assert ("status", 200) in victim_events
        assert ended_with_error(victim_events), victim_events[-3:]
        assert text == own_greedy(survivor_case["prompt_tokens"], len(survivor_case["completion_tokens"]))
        survivors = [x for x in c.nodes if x is not busy[0]]
        assert wait_idle(survivors), "survivors kept pages"
        # The cluster keeps serving on the surviving decode node.
        assert complete_ids(c, GOLDEN[0]["prompt_tokens"], 4)[0] == complete_ids(mono, GOLDEN[0]["prompt_tokens"], 4)[0]
    finally:
        c.stop()


def test_killing_a_prefill_node_mid_handoff(tmp_path):
    """Two prefill nodes: a long prompt's prefill node is killed while it computes and
    hands over the K/V; that client gets an error status, never a 200; the decode node
    releases the reservation; a request on the other prefill node answers correctly."""
    c = Cluster(["--kv-pool-tokens", "8192"], tmp_path, prefill=2, decode=1)
    try:
        long_prompt = (GOLDEN[3]["prompt_tokens"] * 400)[:6000]
        result = {}

        def victim():
            try:
                result["r"] = c.post(
                    "/v1/completions",
                    {"model": MODEL_NAME, "prompt": long_prompt, "max_tokens": 4, "temperature": 0},
                )
            except requests.RequestException as e:
                result["e"] = e

        t = threading.Thread(target=victim)
        t.start()
        deadline = time.monotonic() + 60
        busy = []
        while not busy and time.monotonic() < deadline:
            busy = [n for n in c.prefill_nodes() if n.metrics()['kvwarden_kv_pages{state="leased"}'] > 0]
            time.sleep(0.05)
        assert busy, "the long prefill never started"
        busy[0].proc.send_signal(signal.SIGKILL)
        busy[0].proc.wait(timeout=30)
        t.join(timeout=120)
        assert not t.is_alive(), "the client hung"
        assert "r" in result, result
        assert result["r"].status_code >= 500, result["r"].text
        assert result["r"].json()["error"]["code"] in ("service_unavailable", "upstream_timeout", "kv_handoff_failed")
        decode = c.decode_nodes()[0]
        assert wait_idle([decode]), "the decode node kept the reservation"
        # The router marks the dead node down within a poll and uses the other one.
        time.sleep(2)
        case = GOLDEN[4]
        text = complete_ids(c, case["prompt_tokens"], len(case["completion_tokens"]))[0]
        assert text == own_greedy(case["prompt_tokens"], len(case["completion_tokens"]))
    finally:
        c.stop()


def test_prefix_affinity_stays_within_a_tenant(tmp_path):
    """Two prefill nodes. Alice's prompt is cached on the node that ran it; while that node
    is busy with Bob's long prompt, the least loaded node is the other one, yet Alice's
    repeat goes back to hers and hits her cache. Bob's identical prompt hits nothing."""
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-alice alice\nsk-bob bob\n")
    c = Cluster(
        ["--kv-pool-tokens", "8192", "--api-keys", keys], tmp_path, prefill=2, decode=1,
        api_key="sk-alice",
    )
    try:
        alice, bob = c.client_for("sk-alice"), c.client_for("sk-bob")
        prompt = " ".join(f"word{i}" for i in range(120))

        def ask(client, text=prompt, max_tokens=2):
            r = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=max_tokens, temperature=0)
            return r.usage.prompt_tokens_details.cached_tokens

        assert ask(alice) == 0
        busy = threading.Thread(
            target=lambda: ask(bob, " ".join(f"other{i}" for i in range(300)), 1)
        )
        busy.start()
        deadline = time.monotonic() + 60
        while not any(n.metrics()["kvwarden_requests_running"] > 0 for n in c.prefill_nodes()):
            assert time.monotonic() < deadline and busy.is_alive(), "Bob's prefill never ran"
            time.sleep(0.05)
        assert ask(alice) >= 64, "the repeat missed the node holding the tenant's prefix"
        busy.join(timeout=120)
        assert ask(bob) == 0, "a cached prefix crossed tenants"
        assert c.metrics()["kvwarden_router_prefix_affinity_hits_total"] >= 1
    finally:
        c.stop()


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_node_down_at_start_joins_when_it_answers(tmp_path, mono):
    """The router starts with one of its two decode nodes not yet running, serves through
    the other, takes the late one in once it answers, and keeps serving through it when the
    first is killed."""
    certs = make_certs(tmp_path / "certs", ["router", "prefill0", "decode0", "decode1"])
    late_port = free_port()
    nodes = [
        Node("prefill", ["--kv-pool-tokens", "4096"], certs, "prefill0", tmp_path / "p.log"),
        Node("decode", ["--kv-pool-tokens", "4096"], certs, "decode0", tmp_path / "d0.log"),
    ]
    router = None
    try:
        log = tmp_path / "router.log"
        router = subprocess.Popen(
            [
                str(BIN), "router", "--model", str(MODEL), "--port", "0", "--served-model-name", MODEL_NAME,
                "--prefill", nodes[0].addr, "--decode", nodes[1].addr, f"127.0.0.1:{late_port}",
                "--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "router.pem"),
                "--tls-key", str(certs / "router.key"),
            ],
            stdout=subprocess.DEVNULL, stderr=open(log, "wb"), cwd=ROOT,
        )
        from conftest import wait_for_line

        url = wait_for_line(router, log, r"listening on (http://[0-9.]+:\d+)", "router")
        case = GOLDEN[0]

        class Via:
            def __init__(self, url):
                self.url = url

            def post(self, path, body):
                return requests.post(self.url + path, json=body, timeout=120)

        via = Via(url)
        want = complete_ids(mono, case["prompt_tokens"], 8)[0]
        assert complete_ids(via, case["prompt_tokens"], 8)[0] == want
        nodes.append(
            Node("decode", ["--kv-pool-tokens", "4096"], certs, "decode1", tmp_path / "d1.log", port=late_port)
        )
        up = f'kvwarden_router_node_up{{role="decode",node="127.0.0.1:{late_port}"}}'
        deadline = time.monotonic() + 30
        while requests.get(url + "/metrics", timeout=10).text.find(up + " 1") < 0:
            assert time.monotonic() < deadline, "the late node never joined"
            time.sleep(0.2)
        nodes[1].proc.send_signal(signal.SIGKILL)
        nodes[1].proc.wait()
        assert complete_ids(via, case["prompt_tokens"], 8)[0] == want
        assert nodes[2].metrics()["kvwarden_node_decode_requests_total"] >= 1
    finally:
        if router is not None:
            router.terminate()
            router.wait()
        for n in nodes:
            n.stop()


# Pools small enough that the model's 8,192-token context does not cap what they hold.
@pytest.mark.parametrize("dtype,block_bytes,mib", [("q8_0", 34, 64), ("q4_0", 18, 32)])
def test_block_kv_through_the_router_equals_serve(tmp_path, dtype, block_bytes, mib):
    """--kv-dtype q8_0 or q4_0 on every node: each golden prompt's tokens and logprob bits
    through prefill -> handoff -> decode equal a monolithic server's of the same type; the
    handoff moves the format's bytes per 32 values (34, 18); a pool of `mib` holds the
    tokens that many blocks make (1.88x, 3.56x f16's)."""
    flags = ["--kv-pool-mib", str(mib), "--kv-dtype", dtype]
    mono = Server(flags, tmp_path / "mono.log")
    c = Cluster(flags, tmp_path / "cluster")
    try:
        # 30 layers x (K + V) x 192 values, in blocks of 32; 16-token pages.
        per_token = 30 * 2 * 192 // 32 * block_bytes
        pages = (mib << 20) // (16 * per_token)
        assert mono.client.models.list().data[0].model_extra["max_model_len"] == 16 * pages
        f16_pages = (mib << 20) // (16 * 30 * 2 * 192 * 2)
        assert pages / f16_pages > 0.99 * 64 / block_bytes
        before = c.metrics()['kvwarden_transfer_bytes_total{direction="received"}']
        prompt_tokens = 0
        for case in GOLDEN:
            n = len(case["completion_tokens"])
            got = complete_ids(c, case["prompt_tokens"], n)
            want = complete_ids(mono, case["prompt_tokens"], n)
            assert got[:3] == want[:3], case["prompt"]
            prompt_tokens += len(case["prompt_tokens"])
        moved = c.metrics()['kvwarden_transfer_bytes_total{direction="received"}'] - before
        assert moved == prompt_tokens * per_token
    finally:
        c.stop()
        mono.stop()


def test_router_refuses_nodes_of_different_kv_types(tmp_path):
    certs = make_certs(tmp_path / "certs", ["router", "prefill0", "decode0"])
    nodes = [
        Node("prefill", ["--kv-pool-tokens", "512", "--kv-dtype", "q8_0"], certs, "prefill0",
             tmp_path / "p.log"),
        Node("decode", ["--kv-pool-tokens", "512"], certs, "decode0", tmp_path / "d.log"),
    ]
    try:
        err = router_refusal(certs, nodes)
        assert "q8_0" in err and "f16" in err, err
    finally:
        for n in nodes:
            n.stop()
