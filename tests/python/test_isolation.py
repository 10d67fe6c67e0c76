"""No request sees another's data: batch invariance on poisoned pages, cancellation
returns pages, tenants share no cache."""

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import MODEL_NAME, SYSTEM, TENANT_KEYS

SUBJECTS = [
    "the ocean", "a small village", "mountains in winter", "an old library", "the first computer",
    "a red bicycle", "rain at night", "the moon landing", "a cup of tea", "honeybees",
    "the history of bread", "a lighthouse keeper", "desert plants", "jazz music", "a chess game",
    "volcanoes",
]
# Prompts of different lengths, so prefill chunks and decode rows mix differently.
PROMPTS = [f"Write one sentence about {s}." + " Be clear." * (2 * i) for i, s in enumerate(SUBJECTS)]


def greedy(server, prompt, max_tokens=8):
    r = server.client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0
    )
    return r.choices[0].logprobs.tokens, r.choices[0].text, r.usage.prompt_tokens


def test_batch_invariance_on_poisoned_pages(poison_server):
    alone = [greedy(poison_server, p) for p in PROMPTS]
    assert len({n for _, _, n in alone}) == len(PROMPTS), "prompt lengths should all differ"
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: greedy(poison_server, p), PROMPTS))
    for prompt, a, b in zip(PROMPTS, alone, together):
        assert a == b, f"batched output differs for {prompt!r}: {a} vs {b}"
        assert a[0], prompt
    # NaN-filled pages were reused many times over; a stale read would have shown.
    m = poison_server.metrics()
    assert m["kvwarden_isolation_check_failures_total"] == 0
    assert m['kvwarden_requests_total{outcome="error"}'] == 0


def kv_leased(server):
    return server.metrics()['kvwarden_kv_pages{state="leased"}']


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_disconnect_cancels_and_frees_pages(server):
    assert wait_for(lambda: kv_leased(server) == 0)
    cancelled = server.metrics()['kvwarden_requests_total{outcome="cancelled"}']
    stream = server.client.completions.create(
        model=MODEL_NAME,
        prompt="Tell me a very long story.",
        max_tokens=2000,
        temperature=0.8,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = 0
    for chunk in stream:
        got += 1
        if got == 3:
            break
    assert kv_leased(server) > 0, "a running request holds pages"
    stream.close()
    assert wait_for(lambda: kv_leased(server) == 0), "pages were not released after disconnect"
    m = server.metrics()
    assert m['kvwarden_requests_total{outcome="cancelled"}'] == cancelled + 1
    assert m['kvwarden_kv_pages{state="free"}'] == m['kvwarden_kv_pages{state="total"}'] - m[
        'kvwarden_kv_pages{state="cached"}'
    ]


def test_disconnect_of_a_non_streamed_request_cancels_it(server):
    assert wait_for(lambda: kv_leased(server) == 0)
    cancelled = server.metrics()['kvwarden_requests_total{outcome="cancelled"}']
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "prompt": "Tell me a very long story.",
            "max_tokens": 2000,
            "temperature": 0.8,
            "ignore_eos": True,
        }
    ).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert wait_for(lambda: kv_leased(server) > 0), "the request never started"
    assert wait_for(lambda: kv_leased(server) == 0), "pages were not released after disconnect"
    assert server.metrics()['kvwarden_requests_total{outcome="cancelled"}'] == cancelled + 1


def test_stop_string_releases_the_engine_request(server):
    r = server.client.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", max_tokens=500, temperature=0, stop=["."]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 500
    assert wait_for(lambda: kv_leased(server) == 0)


def test_a_stop_string_ends_a_request_as_stop_counted_once(server):
    """One count of requests (by how the client saw them end) and one of tokens: a stop
    string is a stop, not a cancellation, and no second, engine-side request count exists."""
    assert wait_for(lambda: kv_leased(server) == 0)
    before = server.metrics()
    r = server.client.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", max_tokens=500, temperature=0, stop=["."]
    )
    assert r.choices[0].finish_reason == "stop"
    assert wait_for(lambda: kv_leased(server) == 0)
    after = server.metrics()

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    assert delta('kvwarden_requests_total{outcome="stop"}') == 1
    assert delta('kvwarden_requests_total{outcome="cancelled"}') == 0
    assert not [k for k in after if k.startswith("kvwarden_engine_requests_total")]
    assert delta("kvwarden_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("kvwarden_generation_tokens_total") >= r.usage.completion_tokens


FRANCE = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the capital of France? Answer in one word."},
]


def test_tenants_share_no_cached_prefix(tenant_server):
    alice = tenant_server.client_for(TENANT_KEYS["alice"])
    bob = tenant_server.client_for(TENANT_KEYS["bob"])

    def ask(client, **kw):
        return client.chat.completions.create(
            model=MODEL_NAME, messages=FRANCE, max_tokens=6, temperature=0, **kw
        )

    first = ask(alice)
    again = ask(alice)
    theirs = ask(bob)
    assert theirs.usage.prompt_tokens == first.usage.prompt_tokens
    assert theirs.usage.prompt_tokens_details.cached_tokens == 0
    # Within one tenant the prefix is reused (whole pages, never the last token): a cache
    # that were simply off would give 0 here.
    mine = again.usage.prompt_tokens_details.cached_tokens
    assert mine > 0 and mine % 16 == 0 and mine < again.usage.prompt_tokens
    # Same request, same tokens, whichever tenant asks and whatever is cached.
    assert theirs.choices[0].message.content == first.choices[0].message.content
    assert again.choices[0].message.content == first.choices[0].message.content
    salted = ask(alice, extra_body={"cache_salt": "project-x"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert salted.choices[0].message.content == first.choices[0].message.content


@pytest.mark.parametrize("salt", [""])
def test_empty_cache_salt_is_refused(tenant_server, salt):
    r = tenant_server.post(
        "/v1/chat/completions", {"model": MODEL_NAME, "messages": FRANCE, "cache_salt": salt}
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "cache_salt"


def test_preemption_under_a_small_pool_keeps_every_answer(make_server):
    """A pool too small for the load: requests give their pages back and recompute, on
    poisoned pages, and every answer is still token for token what it is alone."""
    tight = make_server(
        "--kv-pool-tokens", "384", "--max-context", "384", "--kv-scrub", "poison",
        "--no-prefix-cache", name="tight",
    )
    prompts = [f"Tell a long story about {s}." for s in SUBJECTS[:4]]

    def run(prompt):
        r = tight.client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=120, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].logprobs.tokens

    alone = [run(p) for p in prompts]
    assert tight.metrics()["kvwarden_preemptions_total"] == 0
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        together = list(pool.map(run, prompts))
    assert together == alone
    m = tight.metrics()
    assert m["kvwarden_preemptions_total"] > 0, "the pool was meant to run dry"
    assert m["kvwarden_isolation_check_failures_total"] == 0
    assert wait_for(lambda: kv_leased(tight) == 0)
