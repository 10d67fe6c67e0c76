"""Gemma 3 270M (Q4_K_M, a SentencePiece vocabulary of 262,144 tokens, sliding-window
layers) served end to end and answered as llama.cpp answers with the same file
(tests/data/gemma3/references.json, recorded by scripts/record-gemma3-references.py).

The file has no chat template; both servers are given templates/gemma3.jinja. Always one
`kvwarden serve` (scripts/test.sh runs this module once, not again through the router).
"""

import json
import subprocess

import pytest

from conftest import BIN, ROOT, Server

GEMMA = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"
NAME = "gemma-3-270m"
REFS = json.loads((ROOT / "tests/data/gemma3/references.json").read_text())


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    if not GEMMA.is_file():
        # Fetched (and sha256-checked) by the project's script; a failure fails the test.
        subprocess.run([str(ROOT / "scripts/fetch-gemma3.sh")], check=True)
    s = Server(
        ["--kv-pool-tokens", "2048", "--chat-template", ROOT / "templates/gemma3.jinja"],
        tmp_path_factory.mktemp("gemma3") / "stderr.log",
        model=GEMMA,
        model_name=NAME,
    )
    yield s
    s.stop()


def test_gemma3_chat_answers_through_its_template_as_llama_cpp(gemma):
    chat = REFS["chat"]
    r = gemma.client.chat.completions.create(
        model=NAME, messages=chat["messages"], temperature=0, max_tokens=8
    )
    answer = r.choices[0].message.content
    assert "Paris" in answer
    assert answer == chat["answer"]
    assert r.usage.completion_tokens == 8
    # The prompt is the template's rendering with one BOS (the template's own).
    rendered = "<bos>" + chat["prompt"]
    ids = json.loads(subprocess.run(
        [str(BIN), "tokenize", "--model", str(GEMMA), "--text", rendered],
        check=True, capture_output=True, text=True,
    ).stdout)["tokens"]
    assert ids[0] == 2 and ids.count(2) == 1
    assert r.usage.prompt_tokens == len(ids)


def test_gemma3_long_prompt_crosses_the_sliding_window(gemma):
    # 692 tokens: the local layers see only the last 512 positions, the global ones all.
    case = next(c for c in REFS["completions"] if len(c["prompt"]) > 512)
    assert case["decisive_prefix"] == len(case["tokens"])
    r = gemma.client.completions.create(
        model=NAME, prompt=case["prompt"], temperature=0, max_tokens=len(case["tokens"])
    )
    assert r.usage.prompt_tokens == len(case["prompt"])
    assert r.usage.completion_tokens == len(case["tokens"])
    assert r.choices[0].text == case["content"]
