"""Fairness between tenants in the prefix cache's eviction (issue 10): a tenant that floods
a small pool with distinct prompts evicts its own cached prefixes, not another tenant's.
Under the old global LRU, Bob's prefix (cached first, used least recently) would be the
first to go and his second request would find nothing cached. Pass/fail checks cached
token counts and content, never timings."""

import requests

from conftest import MODEL_NAME, TENANT_KEYS

ALICE, BOB = TENANT_KEYS["alice"], TENANT_KEYS["bob"]
POOL_TOKENS = 1024
PAGE_TOKENS = 16


def complete(server, key, prompt, max_tokens=2):
    r = requests.post(
        server.url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        headers={"Authorization": f"Bearer {key}"}, timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer):
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_flood_cannot_evict_another_tenants_prefix(make_server, tmp_path_factory):
    keys = tmp_path_factory.mktemp("fairness-keys") / "api-keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, k in TENANT_KEYS.items()))
    s = make_server(
        "--kv-pool-tokens", POOL_TOKENS, "--max-context", POOL_TOKENS, "--api-keys", keys,
        api_key=ALICE, name="fairness",
    )
    # ~300 tokens of Bob's, cached once.
    bob_prompt = "Bob's private notes. " + " ".join(f"item {i} is blue;" for i in range(60))
    first = complete(s, BOB, bob_prompt)
    assert cached(first) == 0
    bob_pages = (first["usage"]["prompt_tokens"] - 1) // PAGE_TOKENS
    assert bob_pages >= 8, first["usage"]
    # Alice floods: distinct prompts of ~300 tokens, together several times the pool.
    flood_tokens = 0
    for n in range(8):
        a = complete(s, ALICE, f"Alice document {n}. " + " ".join(f"row {n}-{i} is red;" for i in range(60)))
        flood_tokens += a["usage"]["prompt_tokens"]
    assert flood_tokens > 3 * POOL_TOKENS, flood_tokens
    # Bob's prefix is still whole: the flood evicted Alice's own entries.
    again = complete(s, BOB, bob_prompt)
    assert cached(again) == bob_pages * PAGE_TOKENS, again["usage"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    # Alice's newest prompt is cached too (her oldest went first): her share works for her.
    last = complete(s, ALICE, "Alice document 7. " + " ".join(f"row 7-{i} is red;" for i in range(60)))
    assert cached(last) > 0, last["usage"]
