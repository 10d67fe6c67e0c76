"""Per-tenant limits (--tenant-max-requests, --tenant-max-tokens): a tenant that floods the
server is refused with 429 in OpenAI's shape (Retry-After, rate_limit_error), while another
tenant's requests still succeed with the same content as on an idle server. Pass/fail
checks statuses and content, never timings (the deadlines are liveness bounds)."""

import concurrent.futures
import time

import openai
import pytest
import requests

from conftest import MODEL_NAME, TENANT_KEYS, parse_metrics

ALICE, BOB = TENANT_KEYS["alice"], TENANT_KEYS["bob"]
# Answered decisively (see test_content.py's FRANCE).
BOB_PROMPT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Name the capital of France."},
]


@pytest.fixture(scope="module")
def limited(make_server, tmp_path_factory):
    keys = tmp_path_factory.mktemp("overload-keys") / "api-keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, k in TENANT_KEYS.items()))
    # The engine's own queue (max-running + max-waiting = 12) is larger than one tenant's
    # share, so every 429 below comes from the tenant limits, not from the global bound.
    return make_server(
        "--kv-pool-tokens", "4096", "--api-keys", keys, "--max-running", "4", "--max-waiting", "8",
        "--tenant-max-requests", "2", "--tenant-max-tokens", "2000",
        api_key=ALICE, name="overload",
    )


def post(server, key, body):
    return requests.post(
        server.url + "/v1/chat/completions" if "messages" in body else server.url + "/v1/completions",
        json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120,
    )


def bob_answer(server):
    r = post(server, BOB, {"model": MODEL_NAME, "messages": BOB_PROMPT, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def hold(server, max_tokens):
    """A streaming request of Alice's that runs (its first chunk arrived) until closed."""
    stream = server.client_for(ALICE).completions.create(
        model=MODEL_NAME, prompt="Tell me a long story.", max_tokens=max_tokens, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )
    for _ in stream:
        break
    return stream


def assert_tenant_429(r, what):
    assert r.status_code == 429, r.text
    assert r.headers["Retry-After"] == "1"
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error", err
    assert err["code"] == "rate_limit_exceeded", err
    assert what in err["message"], err


def test_a_flooding_tenant_gets_429_while_another_is_served(limited):
    unloaded = bob_answer(limited)
    assert "Paris" in unloaded, unloaded
    held = [hold(limited, 900)]
    try:
        # Tokens: 900 + prompt held; another 1200 would exceed 2000.
        r = post(limited, ALICE, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1200})
        assert_tenant_429(r, "tokens")
        held.append(hold(limited, 900))
        # Requests: two in progress, the limit. A flood of them is refused, all of it...
        flood = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            alice = [pool.submit(post, limited, ALICE, flood) for _ in range(16)]
            # Bob sends as many at once as his own limit allows.
            bob = [pool.submit(bob_answer, limited) for _ in range(2)]
            for f in alice:
                assert_tenant_429(f.result(), "requests in progress")
            # ...while the other tenant's requests succeed, with the unloaded answer.
            for f in bob:
                assert f.result() == unloaded
        # The official client sees the refusal as a rate limit.
        with pytest.raises(openai.RateLimitError):
            limited.client_for(ALICE).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
        m = parse_metrics(requests.get(
            limited.url + "/metrics", headers={"Authorization": f"Bearer {BOB}"}, timeout=10
        ).text)
        assert m.get('kvwarden_rejections_total{reason="rate_limit_exceeded"}', 0) >= 17, m
    finally:
        for s in held:
            s.close()
    # Liveness: a closed stream gives its tenant's place back.
    deadline = time.monotonic() + 60
    while True:
        r = post(limited, ALICE, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})
        if r.status_code != 429 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert r.status_code == 200, r.text


def test_tenant_limits_must_be_positive():
    from test_limits import run_serve

    r = run_serve("--tenant-max-requests", 0)
    assert r.returncode != 0
    assert "--tenant-max-requests" in r.stderr, r.stderr
    assert "listening" not in r.stderr
