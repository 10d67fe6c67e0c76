"""Speculative decoding through the public API (and, in the cluster form, on the decode
node behind the router): with drafts on every decode row, from prompt lookup and from a
draft model, every answer to 112 requests (56 prompts, greedy and seeded; 56 of them for
the draft model) is the answer of a server that never speculates, token for token and
log-probability for log-probability, one at a time and concurrently; drafts are kept and
rejected. A draft model of another vocabulary is refused at start."""

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import BIN, MODEL, MODEL_NAME, ROOT, own_greedy, require_binary

# The default model requantized (scripts/fetch-quant-models.sh): the same vocabulary, other
# weights, so its drafts are mostly, not always, what the served model decodes.
DRAFT = ROOT / "models" / "SmolLM2-135M-Instruct.Q2_K.gguf"
# A synthetic model (scripts/make-synthetic-models.sh) with a vocabulary of its own.
FOREIGN = ROOT / "models" / "synth-qwen3-q6_k.gguf"

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of "
    "oil and a cloth. He polished the great lens until it gleamed, trimmed the wick, and lit "
    "the lamp.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n",
    "Order 1042: two boxes of green tea, one kettle, shipped to 14 Elm Street on Monday. "
    "Order 1043: three boxes of black tea, shipped to 9 Oak Road on Tuesday.",
    "To make bread, mix 500 grams of flour, 10 grams of salt, 7 grams of yeast and 350 "
    "millilitres of water. Knead for ten minutes, rest for an hour, shape and bake.",
    "| city | country | people |\n| Paris | France | 2,100,000 |\n| Rome | Italy | 2,800,000 |\n"
    "| Madrid | Spain | 3,300,000 |",
]


def prompts():
    """56 prompts: passages to repeat, quote, edit or continue (what prompt lookup drafts
    for), and prompts whose answers repeat nothing."""
    asks = [
        "Repeat the following text exactly.\n\n{p}\n\nThe text again:\n",
        "{p}\n\nRewrite the text above with every number spelled out:\n",
        "Quote the first sentence of this text.\n{p}\nQuote:",
        "{p}\nSummarize the text above in one sentence:",
        "Text: {p}\nThe same text in capital letters:",
        "Fix any spelling mistakes in: {p}\nCorrected:",
        "{p}\n\nContinue:",
        "Translate into French: {p}\nFrench:",
    ]
    out = [a.format(p=p) for p in PASSAGES for a in asks]
    out += [f"Write a short story about {x}." for x in ("a dragon", "a lighthouse", "the sea")]
    out += [f"List the numbers from {k} to {k + 30}:" for k in (1, 50, 300)]
    out += ["Name the capital of France.", "What is two plus two?", "Say hello.",
            "Count backwards from 20.", "Name three colours."]
    out += [f"Spell the word {w} letter by letter:" for w in ("lighthouse", "kettle", "fibonacci")]
    out += ["Write the alphabet:", "Repeat the word tea ten times:"]
    assert len(out) == 56, len(out)
    return out


def sampling(i):
    if i % 2 == 0:
        return {"temperature": 0}
    return {"temperature": 0.8, "seed": 100 + i, "top_p": 0.95, "frequency_penalty": 0.2}


def answer(server, prompt, params):
    r = requests.post(
        server.url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 32, "logprobs": 2, **params},
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


@pytest.fixture(scope="module")
def drafting(make_server):
    assert DRAFT.is_file(), f"{DRAFT} missing: run scripts/fetch-quant-models.sh"
    # The same size as the model: drafts would never pay, so the test says they cost little.
    return make_server("--kv-pool-tokens", "4096", "--speculation", "on", "--draft-model", DRAFT,
                       "--draft-cost", "0.05", name="drafting")


@pytest.fixture(scope="module")
def expected(plain):
    # Plain decoding's answers do not depend on the batch (invariant 16): computed
    # concurrently, they are its answers alone.
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda c: answer(plain, *c), cases()))


def test_speculation_gives_the_answers_of_plain_decoding(plain, expected, speculating):
    check_speculation(plain, expected, speculating, range(len(cases())))


def test_a_draft_model_gives_the_answers_of_plain_decoding(plain, expected, drafting):
    # Every prompt once, greedy and seeded by turns (the engine's own test runs 120 more).
    check_speculation(plain, expected, drafting, range(len(prompts())))


def test_golden_prompts_answer_as_plain_decoding_does(speculating, drafting):
    """The golden prompts (tests/data/golden), greedy, drafting on every row: each answer
    is kvwarden's own greedy answer from a separate process that never speculates."""
    golden = json.loads((ROOT / "tests" / "data" / "golden" / "completions.json").read_text())["cases"]
    for server in (speculating, drafting):
        for case in golden:
            n = len(case["completion_tokens"])
            r = requests.post(
                server.url + "/v1/completions",
                json={"model": MODEL_NAME, "prompt": case["prompt_tokens"], "max_tokens": n,
                      "temperature": 0},
                headers={"Authorization": f"Bearer {server.api_key}"}, timeout=120,
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == own_greedy(case["prompt_tokens"], n), case["prompt"]


def test_a_draft_model_of_another_vocabulary_is_refused():
    require_binary()
    assert FOREIGN.is_file(), f"{FOREIGN} missing: run scripts/make-synthetic-models.sh"
    r = subprocess.run(
        [str(BIN), "serve", "--model", str(MODEL), "--port", "0", "--kv-pool-tokens", "256",
         "--draft-model", str(FOREIGN)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert r.returncode != 0
    assert "--draft-model" in r.stderr and "vocabulary is not the model's" in r.stderr, r.stderr
    assert "listening" not in r.stderr


def check_speculation(plain, expected, speculating, which):
    chosen = [cases()[i] for i in which]
    before = speculating.metrics()
    alone = [answer(speculating, p, s) for p, s in chosen]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda c: answer(speculating, *c), chosen))
    for i, a, b in zip(which, alone, together):
        assert a == expected[i], f"case {i} alone"
        assert b == expected[i], f"case {i} concurrently"
    after = speculating.metrics()
    drafted = after["kvwarden_draft_tokens_total"] - before.get("kvwarden_draft_tokens_total", 0)
    kept = after["kvwarden_accepted_draft_tokens_total"] - before.get(
        "kvwarden_accepted_draft_tokens_total", 0)
    assert kept > 50, (kept, drafted)
    assert drafted > kept, (kept, drafted)
    assert plain.metrics().get("kvwarden_draft_tokens_total", 0) == 0
