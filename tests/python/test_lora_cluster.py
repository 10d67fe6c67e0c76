"""LoRA adapters through `kvwarden router`: every node is given the same `--lora` files, the
router learns the set from the nodes (it loads no weights) and names a request's adapter to
them by identity. The same prompt under adapter A, adapter B and the base model gives three
different greedy texts, each token for token (and logprob for logprob) what monolithic
`serve` gives under that adapter; K/V cached under one adapter serves no other through the
router either; `--lora-access` applies at the router; and a cluster whose nodes hold
different adapters (one missing, or another file under the same name) does not start: the
router exits naming the difference, and a node that joins later with another set is kept
out, the router's log naming the difference, while the others serve on.
"""

import socket
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from conftest import (
    BIN, MODEL, MODEL_NAME, ROOT, TENANT_KEYS, Cluster, Node, Server, make_certs, synth_lora,
    wait_for_line,
)

PROMPT = "Write a short poem about the sea and the wind:"
ALICE, BOB = TENANT_KEYS["alice"], TENANT_KEYS["bob"]




@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-files")
    return {"a": synth_lora(d / "a.gguf", 1), "b": synth_lora(d / "b.gguf", 2),
            "c": synth_lora(d / "c.gguf", 3)}


def lora_flags(files, **names):
    """`--lora NAME=PATH` for each name given, as lora_a="a" -> lora-a=<files['a']>."""
    return [a for name, f in names.items() for a in ("--lora", f"{name.replace('_', '-')}={files[f]}")]


@pytest.fixture(scope="module")
def mono(tmp_path_factory, files):
    s = Server(["--kv-pool-tokens", "4096", *lora_flags(files, lora_a="a", lora_b="b")],
               tmp_path_factory.mktemp("lora-mono") / "stderr.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, files):
    d = tmp_path_factory.mktemp("lora-cluster")
    keys = d / "api-keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, k in TENANT_KEYS.items()))
    access = d / "lora-access.txt"
    access.write_text("lora-a alice bob\nlora-b alice\n")
    c = Cluster(
        ["--kv-pool-tokens", "4096", "--api-keys", keys, *lora_flags(files, lora_a="a", lora_b="b")],
        d, api_key=ALICE, router_args=["--lora-access", access],
    )
    yield c
    c.stop()


def greedy(server, model, key, prompt=PROMPT, max_tokens=24):
    r = requests.post(
        server.url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
              "logprobs": 1},
        headers={"Authorization": f"Bearer {key}"}, timeout=120,
    )
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"], r.json()["usage"]


def test_each_adapter_through_the_router_answers_as_serve_does(cluster, mono):
    listed = [m.id for m in cluster.client.models.list().data]
    assert listed == [MODEL_NAME, "lora-a", "lora-b"], listed
    texts = {}
    for model in (MODEL_NAME, "lora-a", "lora-b"):
        got = greedy(cluster, model, ALICE)
        want = greedy(mono, model, "unused")
        assert got[:2] == want[:2], (model, got, want)
        texts[model] = got[0]
    assert len(set(texts.values())) == 3, texts


def test_mixed_batches_through_the_router_answer_as_each_alone(cluster, mono):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [PROMPT, "The capital of France is", "List three colours:"]
    calls = [(p, m) for p in prompts for m in (MODEL_NAME, "lora-a", "lora-b")]
    alone = [greedy(mono, m, "unused", p)[:2] for p, m in calls]
    with ThreadPoolExecutor(len(calls)) as pool:
        for _ in range(2):
            mixed = list(pool.map(lambda pm: greedy(cluster, pm[1], ALICE, pm[0])[:2], calls))
            assert mixed == alone


def test_the_audits_timing_check_through_the_router_sees_no_prefix_cross_adapters(cluster, tmp_path):
    import json

    report = tmp_path / "audit.json"
    out = subprocess.run(
        [str(BIN), "audit", "--endpoint", cluster.url, "--no-progress", "--json", str(report),
         "--api-key", ALICE, "--api-key", ALICE, "--tenant-model", "lora-a", "--tenant-model", "lora-b",
         "--checks", "side-channel", "--side-channel-tokens", "384", "--side-channel-trials", "2",
         "--seed", "5"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    sc = json.loads(report.read_text())["side_channel"]
    assert all(t["a_repeat_cached"] > 0 for t in sc["trials"]), sc
    assert all(t["b_same_prefix_cached"] == 0 for t in sc["trials"]), sc
    assert sc["reported_cross_hit"] is False and sc["timing_cross_hit"] is False, sc


def test_the_prefix_cache_serves_no_other_adapter_through_the_router(cluster):
    # Longer than a few pages, so that a cache hit would show.
    prompt = PROMPT + " " + "The tide rolls in, the gulls cry out, the harbour lights burn low. " * 6
    first = greedy(cluster, "lora-a", ALICE, prompt, max_tokens=2)
    again = greedy(cluster, "lora-a", ALICE, prompt, max_tokens=2)
    assert again[:2] == first[:2]
    cached = lambda usage: (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert cached(again[2]) > 0, again[2]
    for model in ("lora-b", MODEL_NAME):
        other = greedy(cluster, model, ALICE, prompt, max_tokens=2)
        assert cached(other[2]) == 0, (model, other[2])


def test_lora_access_applies_at_the_router(cluster):
    listed = [m.id for m in cluster.client_for(BOB).models.list().data]
    assert listed == [MODEL_NAME, "lora-a"], listed
    r = requests.post(
        cluster.url + "/v1/completions",
        json={"model": "lora-b", "prompt": PROMPT, "max_tokens": 2},
        headers={"Authorization": f"Bearer {BOB}"}, timeout=60,
    )
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found"


def router_refusal(certs: Path, nodes) -> str:
    r = subprocess.run(
        [
            str(BIN), "router", "--model", str(MODEL), "--port", "0",
            "--prefill", nodes[0].addr, "--decode", nodes[1].addr,
            "--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "router.pem"),
            "--tls-key", str(certs / "router.key"),
        ],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert r.returncode != 0 and "listening" not in r.stderr, r.stderr
    return r.stderr


@pytest.mark.parametrize(
    "decode_loras, expected",
    [
        ({"lora_a": "a"}, ["lacks `lora-b`"]),
        ({"lora_a": "a", "lora_b": "c"}, ["its `lora-b` is another version", "fingerprint"]),
    ],
    ids=["missing", "another-file"],
)
def test_a_cluster_whose_decode_node_lacks_an_adapter_does_not_start(
    tmp_path, files, decode_loras, expected
):
    certs = make_certs(tmp_path / "certs", ["router", "prefill0", "decode0"])
    nodes = [
        Node("prefill", ["--kv-pool-tokens", "256", *lora_flags(files, lora_a="a", lora_b="b")],
             certs, "prefill0", tmp_path / "p.log"),
        Node("decode", ["--kv-pool-tokens", "256", *lora_flags(files, **decode_loras)],
             certs, "decode0", tmp_path / "d.log"),
    ]
    try:
        err = router_refusal(certs, nodes)
        assert "LoRA adapters differ" in err and nodes[1].addr in err, err
        for part in expected:
            assert part in err, (part, err)
    finally:
        for n in nodes:
            n.stop()


def test_a_node_that_joins_with_other_adapters_is_kept_out(tmp_path, files):
    """The router starts with one of its two decode nodes down; it comes up holding another
    file under `lora-b`: the router never uses it, says why in its log, and serves every
    adapter through the node that matches."""
    certs = make_certs(tmp_path / "certs", ["router", "prefill0", "decode0", "decode1"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        late_port = s.getsockname()[1]
    same = ["--kv-pool-tokens", "1024", *lora_flags(files, lora_a="a", lora_b="b")]
    nodes = [
        Node("prefill", same, certs, "prefill0", tmp_path / "p.log"),
        Node("decode", same, certs, "decode0", tmp_path / "d0.log"),
    ]
    router = None
    try:
        log = tmp_path / "router.log"
        router = subprocess.Popen(
            [
                str(BIN), "router", "--model", str(MODEL), "--port", "0",
                "--served-model-name", MODEL_NAME,
                "--prefill", nodes[0].addr, "--decode", nodes[1].addr, f"127.0.0.1:{late_port}",
                "--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "router.pem"),
                "--tls-key", str(certs / "router.key"),
            ],
            stdout=subprocess.DEVNULL, stderr=open(log, "wb"), cwd=ROOT,
        )
        url = wait_for_line(router, log, r"listening on (http://[0-9.]+:\d+)", "router")
        nodes.append(Node(
            "decode", ["--kv-pool-tokens", "1024", *lora_flags(files, lora_a="a", lora_b="c")],
            certs, "decode1", tmp_path / "d1.log", port=late_port,
        ))
        deadline = time.monotonic() + 30
        while "is kept out" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.2)
        said = log.read_text(errors="replace")
        assert f"decode node 127.0.0.1:{late_port} is kept out" in said, said
        assert "its `lora-b` is another version" in said, said
        metrics = requests.get(url + "/metrics", timeout=10).text
        assert f'kvwarden_router_node_up{{role="decode",node="127.0.0.1:{late_port}"}} 0' in metrics
        via = SimpleNamespace(url=url)
        for model in ("lora-a", "lora-b", MODEL_NAME, "lora-b"):
            greedy(via, model, "unused", max_tokens=4)
        assert nodes[2].metrics()["kvwarden_node_decode_requests_total"] == 0
        assert nodes[1].metrics()["kvwarden_node_decode_requests_total"] == 4
    finally:
        if router is not None:
            router.terminate()
            router.wait()
        for n in nodes:
            n.stop()
