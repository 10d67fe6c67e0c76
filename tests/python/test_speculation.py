"""Speculative decoding through the public API (and, in the cluster form, on the decode
node behind the router): with drafts on every decode row, every answer is the answer of a
server that never speculates, token for token and log-probability for log-probability,
greedy and seeded, one at a time and concurrently; drafts are kept and rejected."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import MODEL_NAME

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of "
    "oil and a cloth. He polished the great lens until it gleamed, trimmed the wick, and lit "
    "the lamp.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n",
    "Order 1042: two boxes of green tea, one kettle, shipped to 14 Elm Street on Monday. "
    "Order 1043: three boxes of black tea, shipped to 9 Oak Road on Tuesday.",
]


def prompts():
    out = []
    for p in PASSAGES:
        out.append(f"Repeat the following text exactly.\n\n{p}\n\nThe text again:\n")
        out.append(f"{p}\n\nRewrite the text above with every number spelled out:\n")
    out += ["Write a short story about a dragon.", "List the numbers from 1 to 40:",
            "Name the capital of France."]
    return out


def sampling(i):
    if i % 2 == 0:
        return {"temperature": 0}
    return {"temperature": 0.8, "seed": 100 + i, "top_p": 0.95, "frequency_penalty": 0.2}


def answer(server, prompt, params):
    r = requests.post(
        server.url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 48, "logprobs": 2, **params},
        headers={"Authorization": f"Bearer {server.api_key}"}, timeout=120,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]


def cases():
    """Every prompt greedy and seeded."""
    return [(p, sampling(i + k)) for k in (0, 1) for i, p in enumerate(prompts())]


@pytest.fixture(scope="module")
def plain(make_server):
    return make_server("--kv-pool-tokens", "4096", "--speculation", "off", name="plain")


@pytest.fixture(scope="module")
def speculating(make_server):
    return make_server("--kv-pool-tokens", "4096", "--speculation", "on", name="speculating")


def test_speculation_gives_the_answers_of_plain_decoding(plain, speculating):
    expected = [answer(plain, p, s) for p, s in cases()]
    before = speculating.metrics()
    alone = [answer(speculating, p, s) for p, s in cases()]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda c: answer(speculating, *c), cases()))
    for i, (want, a, b) in enumerate(zip(expected, alone, together)):
        assert a == want, f"case {i} alone"
        assert b == want, f"case {i} concurrently"
    after = speculating.metrics()
    drafted = after["kvwarden_draft_tokens_total"] - before.get("kvwarden_draft_tokens_total", 0)
    kept = after["kvwarden_accepted_draft_tokens_total"] - before.get(
        "kvwarden_accepted_draft_tokens_total", 0)
    assert kept > 50, (kept, drafted)
    assert drafted > kept, (kept, drafted)
    assert plain.metrics().get("kvwarden_draft_tokens_total", 0) == 0
