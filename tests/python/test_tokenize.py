"""llama.cpp's /tokenize and /detokenize: the server's own tokenizer, behind the API keys,
with the same limits as a prompt."""

import requests

from conftest import TENANT_KEYS, tokenize

TEXT = "Hello world! <|im_start|>user\nHow many tokens is this?"


def test_tokenize_matches_the_tokenizer_and_detokenize_inverts_it(server):
    r = server.post("/tokenize", {"content": TEXT})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert tokens == tokenize(TEXT)
    back = server.post("/detokenize", {"tokens": tokens})
    assert back.status_code == 200, back.text
    assert back.json() == {"content": TEXT}
    pieces = server.post("/tokenize", {"content": TEXT, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tokens
    assert "".join(p["piece"] for p in pieces) == TEXT


def test_parse_special_false_reads_control_text_as_text(server):
    marker = "<|im_start|>"
    [control] = server.post("/tokenize", {"content": marker}).json()["tokens"]
    plain = server.post("/tokenize", {"content": marker, "parse_special": False}).json()["tokens"]
    assert control not in plain and len(plain) > 1
    assert server.post("/detokenize", {"tokens": plain}).json()["content"] == marker


def test_tokenize_refusals(server, small_server):
    for path, body, code, param in [
        ("/detokenize", {"tokens": [1, 99999]}, "invalid_token", "tokens"),
        ("/tokenize", {"content": "x", "grammar": "y"}, "unsupported_parameter", "grammar"),
        ("/tokenize", {"text": "x"}, "unsupported_parameter", "text"),
        ("/detokenize", {"tokens": "abc"}, "invalid_type", "tokens"),
    ]:
        r = server.post(path, body)
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert (err["code"], err["param"]) == (code, param), err
    # A text that could not fit the context is refused before it is tokenized.
    r = small_server.post("/tokenize", {"content": "word " * 10000})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_tokenize_needs_a_key(tenant_server):
    url = tenant_server.url
    for path, body in [("/tokenize", {"content": "hi"}), ("/detokenize", {"tokens": [1]})]:
        r = requests.post(url + path, json=body, timeout=30)
        assert r.status_code == 401, r.text
        ok = requests.post(
            url + path, json=body, headers={"Authorization": f"Bearer {TENANT_KEYS['bob']}"}, timeout=30
        )
        assert ok.status_code == 200, ok.text
