"""LoRA adapters per tenant, through the official `openai` client: each tenant lists and
reaches only its own adapters (another's answers exactly as one that does not exist); the
same prompt under adapter A, adapter B and the base gives three answers, each that of a
server serving only that adapter, alone and in mixed batches; a shared-prefix flood under
A gives no cached token to B or to the base; llama.cpp's `lora` field selects as `model`
does; the operator API loads an adapter while serving and unloads it under a running
stream, which finishes with the adapter it started with; and the operator API opens with
its own token only, on its own listener; `kvwarden audit`'s timing check, run with one
tenant under two adapters (and under an adapter and the base), sees no shared prefix.

`serve` only: the operator API is `serve`'s, and test_lora_cluster.py runs the rest through
the router."""

import json
import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from conftest import (
    BIN, DEPLOYMENT, MODEL, MODEL_NAME, ROOT, TENANT_KEYS, parse_metrics, require_binary, synth_lora,
)

pytestmark = pytest.mark.skipif(
    DEPLOYMENT == "cluster", reason="test_lora_cluster.py covers the router"
)

ALICE, BOB = TENANT_KEYS["alice"], TENANT_KEYS["bob"]
PROMPT = "Write a short poem about the sea and the wind:"
ADMIN_TOKEN = "op-token-5b2d9e"




@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    keys = d / "api-keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, k in TENANT_KEYS.items()))
    access = d / "lora-access.txt"
    access.write_text("# who may use which\n\nlora-a alice\nlora-b bob\n")
    token = d / "admin-token"
    token.write_text(ADMIN_TOKEN + "\n")
    return {
        "dir": d,
        "keys": keys,
        "access": access,
        "token": token,
        "a": synth_lora(d / "a.gguf", 1),
        "b": synth_lora(d / "b.gguf", 2),
        "c": synth_lora(d / "c.gguf", 3),
    }


@pytest.fixture(scope="module")
def lora_server(make_server, files):
    s = make_server(
        "--kv-pool-tokens", "4096", "--api-keys", files["keys"],
        "--lora", f"lora-a={files['a']}", "--lora", f"lora-b={files['b']}",
        "--lora-access", files["access"],
        "--admin-listen", "127.0.0.1:0", "--admin-token-file", files["token"],
        api_key=ALICE, name="lora",
    )
    m = re.search(r"operator API on (http://[0-9.]+:\d+)", s.stderr())
    assert m, s.stderr()
    s.admin = m.group(1)
    return s


@pytest.fixture(scope="module")
def alone_a(make_server, files):
    return make_server("--kv-pool-tokens", "2048", "--lora", f"lora-a={files['a']}", name="lora-a")


@pytest.fixture(scope="module")
def alone_b(make_server, files):
    return make_server("--kv-pool-tokens", "2048", "--lora", f"lora-b={files['b']}", name="lora-b")


@pytest.fixture(scope="module")
def base_alone(make_server):
    return make_server("--kv-pool-tokens", "2048", name="lora-base")


def complete(client, model, prompt=PROMPT, max_tokens=24, **extra):
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body=extra or None,
    )
    return r


def text(client, model, **extra):
    return complete(client, model, **extra).choices[0].text


def admin(server, method, path="/v1/adapters", token=ADMIN_TOKEN, **kw):
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return requests.request(method, server.admin + path, headers=headers, timeout=700, **kw)


def test_each_tenant_lists_only_its_own_adapters(lora_server):
    for key, own, other_id in ((ALICE, "lora-a", 1), (BOB, "lora-b", 0)):
        models = lora_server.client_for(key).models.list()
        assert [m.id for m in models.data] == [MODEL_NAME, own]
        raw = requests.get(
            lora_server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10
        ).json()["data"]
        assert raw[1]["parent"] == MODEL_NAME and raw[1]["owned_by"]
        listed = requests.get(
            lora_server.url + "/lora-adapters", headers={"Authorization": f"Bearer {key}"},
            timeout=10,
        ).json()
        assert [(a["id"], a["name"], a["scale"]) for a in listed] == [(1 - other_id, own, 1.0)]
    r = requests.get(lora_server.url + "/lora-adapters", timeout=10)
    assert r.status_code == 401


def not_found(server, key, body):
    r = requests.post(
        server.url + "/v1/completions", json=body,
        headers={"Authorization": f"Bearer {key}"}, timeout=60,
    )
    assert r.status_code == 404, r.text
    return r.headers.get("content-type"), r.json()


def test_another_tenants_adapter_answers_as_no_adapter_at_all(lora_server, alone_a):
    ask = {"prompt": PROMPT, "max_tokens": 4}
    theirs = not_found(lora_server, ALICE, {"model": "lora-b", **ask})
    # The same name where it does not exist at all: the same answer, byte for byte.
    assert not_found(alone_a, "unused", {"model": "lora-b", **ask}) == theirs
    none = not_found(lora_server, ALICE, {"model": "lora-zz", **ask})
    assert json.dumps(none).replace("lora-zz", "lora-b") == json.dumps(theirs)
    assert theirs[1]["error"]["code"] == "model_not_found"
    assert theirs[1]["error"]["message"] == (
        "The model `lora-b` does not exist or you do not have access to it."
    )
    with pytest.raises(openai.NotFoundError) as e:
        complete(lora_server.client_for(BOB), "lora-a")
    assert e.value.code == "model_not_found"
    # By llama.cpp's id: bob's adapter (id 1) answers as an id nobody has.
    by_id = not_found(lora_server, ALICE, {"model": MODEL_NAME, "lora": [{"id": 1, "scale": 1}], **ask})
    nobody = not_found(lora_server, ALICE, {"model": MODEL_NAME, "lora": [{"id": 7, "scale": 1}], **ask})
    assert json.dumps(nobody).replace("id 7", "id 1") == json.dumps(by_id)


def test_each_adapter_answers_as_alone_and_batched(lora_server, alone_a, alone_b, base_alone):
    alice, bob = lora_server.client_for(ALICE), lora_server.client_for(BOB)
    calls = [(alice, "lora-a"), (bob, "lora-b"), (alice, MODEL_NAME)]
    answers = [text(c, m) for c, m in calls]
    assert len(set(answers)) == 3, answers
    assert answers[0] == text(alone_a.client, "lora-a")
    assert answers[1] == text(alone_b.client, "lora-b")
    assert answers[2] == text(base_alone.client, MODEL_NAME)
    # Mixed batches: all three at once, several times over.
    with ThreadPoolExecutor(12) as pool:
        mixed = list(pool.map(lambda cm: text(*cm), calls * 4))
    assert mixed == answers * 4


def test_a_prefix_flood_under_one_adapter_caches_for_no_other(lora_server):
    alice, bob = lora_server.client_for(ALICE), lora_server.client_for(BOB)
    prefix = " ".join(f"Item {i}: a crate of apples weighing {i * 7 % 40 + 3} kilograms." for i in range(24))
    flood = [complete(alice, "lora-a", prompt=f"{prefix}\nQuestion {i}: which item is heaviest?",
                      max_tokens=2) for i in range(8)]
    assert flood[0].usage.prompt_tokens >= 300, flood[0].usage.prompt_tokens
    hits = [r.usage.prompt_tokens_details.cached_tokens for r in flood[1:]]
    assert all(h > 0 for h in hits), hits
    prompt = f"{prefix}\nQuestion 0: which item is heaviest?"
    again = complete(alice, "lora-a", prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    other = complete(bob, "lora-b", prompt=prompt, max_tokens=2)
    base = complete(alice, MODEL_NAME, prompt=prompt, max_tokens=2)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert base.usage.prompt_tokens_details.cached_tokens == 0
    assert other.usage.prompt_tokens == base.usage.prompt_tokens == again.usage.prompt_tokens


@pytest.mark.parametrize("models", [("lora-a", MODEL_NAME), ("lora-a", "lora-audit")])
def test_the_audits_timing_check_agrees_that_no_prefix_crosses_adapters(lora_server, files, models, tmp_path):
    """The same key twice, each with its own model: the audit's side-channel check times
    the second on the first's cached prefix against a fresh one, and reads `usage`."""
    if models[1] == "lora-audit":
        r = admin(lora_server, "POST", json={"name": "lora-audit", "path": str(files["c"]), "tenants": ["alice"]})
        assert r.status_code == 201, r.text
    report = tmp_path / "audit.json"
    out = subprocess.run(
        [str(BIN), "audit", "--endpoint", lora_server.url, "--no-progress", "--json", str(report),
         "--api-key", ALICE, "--api-key", ALICE, "--tenant-model", models[0], "--tenant-model", models[1],
         "--checks", "side-channel", "--side-channel-tokens", "384", "--side-channel-trials", "2",
         "--seed", "5"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rep = json.loads(report.read_text())
    sc = rep["side_channel"]
    # The first model's own repeat is a hit: the cache is there to be found.
    assert all(t["a_repeat_cached"] > 0 for t in sc["trials"]), sc
    assert all(t["b_same_prefix_cached"] == 0 for t in sc["trials"]), sc
    assert sc["reported_cross_hit"] is False and sc["timing_cross_hit"] is False, sc
    check = next(c for c in rep["checks"] if c["check"] == "side_channel")
    assert check["verdict"] == "pass", check
    if models[1] == "lora-audit":
        assert admin(lora_server, "DELETE", "/v1/adapters/lora-audit").status_code == 200


def test_the_lora_field_selects_as_model_does(lora_server):
    alice = lora_server.client_for(ALICE)
    assert text(alice, MODEL_NAME, lora=[{"id": 0, "scale": 1.0}]) == text(alice, "lora-a")
    # Entries at scale 0 are left out, whoever's they are.
    assert text(alice, MODEL_NAME, lora=[{"id": 0, "scale": 0}, {"id": 1, "scale": 0}]) == text(
        alice, MODEL_NAME
    )
    refusals = [
        ({"model": MODEL_NAME, "lora": [{"id": 0, "scale": 0.5}]}, "lora[0].scale"),
        ({"model": "lora-a", "lora": [{"id": 0, "scale": 1}]}, "lora"),
        ({"model": MODEL_NAME, "lora": [{"id": 0, "scale": 1}, {"id": 0, "scale": 1}]}, "lora"),
        ({"model": MODEL_NAME, "lora": {"id": 0}}, "lora"),
        ({"model": MODEL_NAME, "lora": [{"id": -1, "scale": 1}]}, "lora[0].id"),
        ({"model": MODEL_NAME, "lora": [{"id": 0}]}, "lora[0].scale"),
    ]
    for body, param in refusals:
        r = lora_server.post("/v1/completions", {**body, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert (err["type"], err["param"]) == ("invalid_request_error", param), (body, err)
    r = lora_server.post(
        "/v1/completions",
        {"model": MODEL_NAME, "lora": [{"id": 0, "scale": 0.5}], "prompt": PROMPT},
    )
    message = r.json()["error"]["message"]
    assert "not supported" in message and "--lora NAME=PATH,SCALE" in message, message


def test_the_operator_api_needs_its_own_token_on_its_own_listener(lora_server):
    for token in (None, "wrong", ALICE):
        r = admin(lora_server, "GET", token=token)
        assert r.status_code == 401, (token, r.text)
        r = admin(lora_server, "DELETE", "/v1/adapters/lora-a", token=token)
        assert r.status_code == 401, (token, r.text)
    for method in ("GET", "POST"):
        r = requests.request(
            method, lora_server.url + "/v1/adapters", headers={"Authorization": f"Bearer {ALICE}"},
            timeout=10,
        )
        assert r.status_code == 404, r.text
    r = requests.get(lora_server.url + "/v1/adapters",
                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
    assert r.status_code in (401, 404), r.text
    listed = admin(lora_server, "GET").json()["data"]
    by_name = {a["name"]: a for a in listed}
    assert by_name["lora-a"]["tenants"] == ["alice"] and by_name["lora-b"]["tenants"] == ["bob"]
    assert by_name["lora-a"]["rank"] == 16 and by_name["lora-a"]["scale"] == 1.0
    assert re.fullmatch(r"[0-9a-f]{32}", by_name["lora-a"]["fingerprint"])
    assert re.fullmatch(r"[0-9a-f]{32}", by_name["lora-a"]["file_checksum"])
    assert by_name["lora-a"]["fingerprint"] != by_name["lora-b"]["fingerprint"]


def test_hot_load_errors(lora_server, files):
    r = admin(lora_server, "POST", json={"name": "lora-a", "path": str(files["c"])})
    assert r.status_code == 409, r.text
    r = admin(lora_server, "POST", json={"name": MODEL_NAME, "path": str(files["c"])})
    assert r.status_code == 400, r.text
    r = admin(lora_server, "POST", json={"name": "broken", "path": str(MODEL)})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "adapter_refused", r.text
    r = admin(lora_server, "POST", json={"name": "nofile", "path": str(files["dir"] / "nope.gguf")})
    assert r.status_code == 400 and "nope.gguf" in r.json()["error"]["message"], r.text
    r = admin(lora_server, "DELETE", "/v1/adapters/never-loaded")
    assert r.status_code == 404, r.text
    names = [a["name"] for a in admin(lora_server, "GET").json()["data"]]
    assert names == ["lora-a", "lora-b"]


def test_hot_load_then_unload_under_a_running_stream(lora_server, files):
    alice, bob = lora_server.client_for(ALICE), lora_server.client_for(BOB)
    r = admin(lora_server, "POST", json={"name": "lora-c", "path": str(files["c"]), "tenants": ["alice"]})
    assert r.status_code == 201, r.text
    # Ids are never reused: a hot load gets one after every id given so far.
    assert r.json()["tenants"] == ["alice"] and r.json()["id"] >= 2
    assert [m.id for m in alice.models.list().data] == [MODEL_NAME, "lora-a", "lora-c"]
    assert [m.id for m in bob.models.list().data] == [MODEL_NAME, "lora-b"]
    assert text(alice, "lora-c") not in (text(alice, "lora-a"), text(alice, MODEL_NAME))
    with pytest.raises(openai.NotFoundError):
        complete(bob, "lora-c")
    long = dict(model="lora-c", prompt=PROMPT, max_tokens=200, temperature=0,
                extra_body={"ignore_eos": True})
    expected = alice.completions.create(**long).choices[0].text

    stream = alice.completions.create(stream=True, **long)
    chunks = iter(stream)
    got = [next(chunks).choices[0].text]
    deleted = {}

    def unload():
        r = admin(lora_server, "DELETE", "/v1/adapters/lora-c")
        deleted["at"], deleted["reply"] = time.monotonic(), r

    t = threading.Thread(target=unload)
    t.start()
    # Out of service at once: the catalog no longer lists it and a new request gets 404,
    # while the stream still runs.
    deadline = time.monotonic() + 10
    while any(a["name"] == "lora-c" for a in admin(lora_server, "GET").json()["data"]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(openai.NotFoundError):
        complete(alice, "lora-c", max_tokens=1)
    assert "at" not in deleted, "the unload answered while a request still used the adapter"
    finish = None
    for c in chunks:
        got.append(c.choices[0].text)
        finish = c.choices[0].finish_reason or finish
    ended = time.monotonic()
    t.join(timeout=60)
    assert "".join(got) == expected
    assert finish == "length"
    reply = deleted["reply"]
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"name": "lora-c", "unloaded": True, "in_use": 0}
    # It answered once the stream's request had ended (the engine drops it before the
    # client has read its last event, hence the slack).
    assert deleted["at"] > ended - 1.0
    with pytest.raises(openai.NotFoundError):
        complete(alice, "lora-c", max_tokens=1)
    assert [m.id for m in alice.models.list().data] == [MODEL_NAME, "lora-a"]


def start_fails(tmp_path, *args):
    """Runs `kvwarden serve` with `args`, which must refuse to start; its stderr."""
    require_binary()
    p = subprocess.run(
        [str(BIN), "--threads", "2", "serve", "--model", str(MODEL), "--port", "0",
         "--served-model-name", MODEL_NAME, *map(str, args)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert p.returncode != 0, p.stderr
    return p.stderr


def test_bad_adapters_and_access_files_fail_start(tmp_path, files):
    err = start_fails(tmp_path, "--lora", f"broken={MODEL}")
    assert f"--lora broken={MODEL}" in err, err
    missing = tmp_path / "missing.gguf"
    err = start_fails(tmp_path, "--lora", f"gone={missing}")
    assert f"--lora gone={missing}" in err and "cannot read" in err, err
    err = start_fails(tmp_path, "--lora", f"{MODEL_NAME}={files['a']}")
    assert "served model's name" in err, err
    err = start_fails(tmp_path, "--lora", f"x={files['a']}", "--lora", f"x={files['b']}")
    assert "already given" in err, err
    access = tmp_path / "access.txt"
    access.write_text("lora-a alice\n# fine so far\nlora-q bob\n")
    err = start_fails(tmp_path, "--lora", f"lora-a={files['a']}", "--lora-access", access)
    assert "line 3" in err and "lora-q" in err, err
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    err = start_fails(tmp_path, "--admin-listen", "127.0.0.1:0", "--admin-token-file", empty)
    assert "empty" in err, err
    err = start_fails(tmp_path, "--admin-listen", "127.0.0.1:0")
    assert "--admin-token-file" in err, err


def test_per_adapter_counters_are_the_operators_alone(make_server, files, lora_server):
    """The operator's metrics listener counts each adapter's requests (once, however many
    choices) and tokens; behind the API keys, where a tenant may not even learn another's
    adapter names, none are shown."""
    s = make_server(
        "--kv-pool-tokens", "2048", "--api-keys", files["keys"],
        "--lora", f"lora-a={files['a']}", "--lora", f"lora-b={files['b']}",
        "--metrics-listen", "127.0.0.1:0", api_key=ALICE, name="lora-metrics",
    )
    m = re.search(r"metrics on (http://[0-9.]+:\d+)/metrics", s.stderr())
    assert m, s.stderr()
    client = s.client_for(ALICE)
    complete(client, "lora-a", max_tokens=5, ignore_eos=True)
    # Two choices: one request, both choices' tokens.
    complete(client, "lora-a", max_tokens=5, ignore_eos=True, n=2)
    complete(client, MODEL_NAME, max_tokens=5, ignore_eos=True)
    prompt_tokens = complete(client, "lora-b", max_tokens=3, ignore_eos=True).usage.prompt_tokens

    def samples():
        return parse_metrics(requests.get(m.group(1) + "/metrics", timeout=10).text)

    deadline = time.monotonic() + 10
    while samples().get('kvwarden_adapter_generated_tokens_total{adapter="lora-b"}') != 3:
        assert time.monotonic() < deadline, samples()
        time.sleep(0.05)
    got = samples()
    assert got['kvwarden_adapter_requests_total{adapter="lora-a"}'] == 2
    assert got['kvwarden_adapter_generated_tokens_total{adapter="lora-a"}'] == 15
    assert got['kvwarden_adapter_requests_total{adapter="lora-b"}'] == 1
    assert got['kvwarden_adapter_prompt_tokens_total{adapter="lora-b"}'] == prompt_tokens
    assert not any(MODEL_NAME in k for k in got if k.startswith("kvwarden_adapter_"))

    complete(lora_server.client_for(ALICE), "lora-a", max_tokens=2)
    behind_keys = requests.get(
        lora_server.url + "/metrics", headers={"Authorization": f"Bearer {BOB}"}, timeout=10
    ).text
    assert "kvwarden_requests_total" in behind_keys
    assert "kvwarden_adapter_" not in behind_keys and "lora-a" not in behind_keys
