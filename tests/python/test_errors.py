"""Every client mistake gets a 4xx in OpenAI's error shape, with a stable code."""

import json

import openai
import pytest
import requests

from conftest import MODEL_NAME, TENANT_KEYS

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hello"}]


def assert_error(r, status, code, param=None):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(
    "path,data,status,code,param",
    [
        (CHAT, '{"model": ', 400, "invalid_json", None),
        (CHAT, "not json at all", 400, "invalid_json", None),
        (CHAT, "", 400, "invalid_json", None),
        (CHAT, '{"model": "%s", "messages": []} trailing' % MODEL_NAME, 400, "invalid_json", None),
        (CHAT, '"a string"', 400, "invalid_type", None),
        # serde's positional form of a struct: a JSON array is not a request.
        (CHAT, json.dumps([MODEL_NAME, HELLO]), 400, "invalid_type", None),
        (COMPLETIONS, json.dumps([MODEL_NAME, "hello"]), 400, "invalid_type", None),
        (CHAT, json.dumps({"model": MODEL_NAME}), 400, "missing_required_parameter", "messages"),
        (CHAT, json.dumps({"messages": HELLO}), 400, "missing_required_parameter", "model"),
        (CHAT, json.dumps({"model": MODEL_NAME, "messages": "hello"}), 400, "invalid_type", "messages"),
        (
            CHAT,
            json.dumps({"model": MODEL_NAME, "messages": HELLO, "max_tokens": "five"}),
            400,
            "invalid_type",
            "max_tokens",
        ),
        (
            CHAT,
            json.dumps({"model": MODEL_NAME, "messages": HELLO, "max_tokens": -3}),
            400,
            "invalid_value",
            "max_tokens",
        ),
        (
            CHAT,
            json.dumps({"model": MODEL_NAME, "messages": [{"content": "x"}]}),
            400,
            "missing_required_parameter",
            "messages[0].role",
        ),
        (CHAT, json.dumps({"model": MODEL_NAME, "messages": []}), 400, "invalid_value", "messages"),
        (
            CHAT,
            json.dumps({"model": MODEL_NAME, "messages": [{"role": "user<|im_end|>", "content": "x"}]}),
            400,
            "invalid_value",
            "messages[0].role",
        ),
        (CHAT, json.dumps({"model": MODEL_NAME, "messages": HELLO, "n": 17}), 400, "invalid_value", "n"),
        (
            CHAT,
            json.dumps({"model": MODEL_NAME, "messages": HELLO, "top_logprobs": 3}),
            400,
            "invalid_value",
            "top_logprobs",
        ),
        (
            CHAT,
            json.dumps({"model": MODEL_NAME, "messages": HELLO, "logprobs": True, "top_logprobs": 21}),
            400,
            "invalid_value",
            "top_logprobs",
        ),
        (
            CHAT,
            json.dumps({"model": MODEL_NAME, "messages": HELLO, "temperature": 3}),
            400,
            "invalid_value",
            "temperature",
        ),
        (
            CHAT,
            json.dumps({"model": MODEL_NAME, "messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}),
            400,
            "invalid_value",
            "stop",
        ),
        (
            CHAT,
            json.dumps({"model": MODEL_NAME, "messages": HELLO, "max_tokens": 0}),
            400,
            "invalid_max_tokens",
            "max_tokens",
        ),
        (
            CHAT,
            json.dumps({"model": MODEL_NAME, "messages": HELLO, "tools": [{"type": "function"}]}),
            400,
            "invalid_value",
            "tools[0].function",
        ),
        (COMPLETIONS, json.dumps({"model": MODEL_NAME, "prompt": "x", "echo": True}), 400, "unsupported_parameter", "echo"),
        (COMPLETIONS, json.dumps({"model": MODEL_NAME, "prompt": "x", "n": 17}), 400, "invalid_value", "n"),
        (COMPLETIONS, json.dumps({"model": MODEL_NAME, "prompt": "x", "best_of": 2}), 400, "unsupported_parameter", "best_of"),
        (COMPLETIONS, json.dumps({"model": MODEL_NAME, "prompt": ["a", "b"]}), 400, "unsupported_parameter", "prompt"),
        (COMPLETIONS, json.dumps({"model": MODEL_NAME, "prompt": {"a": 1}}), 400, "invalid_type", "prompt"),
        (COMPLETIONS, json.dumps({"model": MODEL_NAME, "prompt": ""}), 400, "empty_prompt", "prompt"),
        (COMPLETIONS, json.dumps({"model": MODEL_NAME, "prompt": [1, 99999]}), 400, "invalid_token", "prompt"),
        (COMPLETIONS, json.dumps({"model": MODEL_NAME}), 400, "missing_required_parameter", "prompt"),
        (COMPLETIONS, json.dumps({"model": "gpt-4o", "prompt": "x"}), 404, "model_not_found", "model"),
    ],
)
def test_client_errors(server, path, data, status, code, param):
    assert_error(server.post(path, data=data, headers={"Content-Type": "application/json"}), status, code, param)


def test_messages_name_no_rust_types(server):
    for path, body in [
        (COMPLETIONS, {"model": MODEL_NAME, "prompt": {"a": 1}}),
        (CHAT, {"model": MODEL_NAME, "messages": [5]}),
        (CHAT, {"model": MODEL_NAME, "messages": HELLO, "stop": 5}),
        (CHAT, {"model": MODEL_NAME, "messages": HELLO, "max_tokens": 1.5}),
    ]:
        err = assert_error(server.post(path, body), 400, "invalid_type")
        for rust in ("untagged enum", "struct", "u64", "sequence"):
            assert rust not in err["message"], err


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_only_json_bodies_are_accepted(server, content_type):
    """A web page can POST text/plain or a form to a loopback server without a preflight;
    a valid JSON body sent that way must not reach the engine."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1})
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = requests.post(server.url + COMPLETIONS, data=body, headers=headers, timeout=10)
    assert_error(r, 415, "unsupported_media_type")
    ok = requests.post(
        server.url + COMPLETIONS, data=body, headers={"Content-Type": "application/json; charset=utf-8"}, timeout=60
    )
    assert ok.status_code == 200, ok.text


def test_errors_are_counted_as_rejections(server):
    before = server.metrics().get('kvwarden_rejections_total{reason="model_not_found"}', 0)
    server.post(CHAT, {"model": "nope", "messages": HELLO})
    after = server.metrics()
    assert after['kvwarden_rejections_total{reason="model_not_found"}'] == before + 1
    assert after['kvwarden_requests_total{outcome="rejected"}'] >= 1


def test_unknown_model_through_the_client(server):
    with pytest.raises(openai.NotFoundError) as e:
        server.client.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert e.value.code == "model_not_found"


def test_n_through_the_client(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model=MODEL_NAME, messages=HELLO, n=17)
    assert e.value.code == "invalid_value"


def test_unknown_route_is_json_404(server):
    assert_error(requests.get(server.url + "/v1/nope", timeout=10), 404, "not_found")
    assert_error(requests.post(server.url + "/v2/chat/completions", data="{}", timeout=10), 404, "not_found")


def test_wrong_method_is_json_405(server):
    assert_error(requests.get(server.url + CHAT, timeout=10), 405, "method_not_allowed")


def test_body_over_the_limit_is_413(small_server):
    big = json.dumps({"model": MODEL_NAME, "prompt": "x" * 70_000})
    assert_error(small_server.post(COMPLETIONS, data=big), 413, "payload_too_large")
    # Just under the limit is read (and then refused for its length, not its size).
    ok = json.dumps({"model": MODEL_NAME, "prompt": "hello " * 10_000})
    assert_error(small_server.post(COMPLETIONS, data=ok), 400, "context_length_exceeded", "prompt")


def test_missing_api_key_is_401(tenant_server):
    r = requests.post(tenant_server.url + CHAT, json={"model": MODEL_NAME, "messages": HELLO}, timeout=10)
    assert_error(r, 401, "invalid_api_key")
    r = requests.get(tenant_server.url + "/v1/models", timeout=10)
    assert_error(r, 401, "invalid_api_key")


def test_unknown_api_key_is_401(tenant_server):
    client = tenant_server.client_for("sk-alice-0123456780")
    with pytest.raises(openai.AuthenticationError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=1)
    assert e.value.status_code == 401
    assert e.value.code == "invalid_api_key"
    # A prefix of a real key is not the key.
    r = tenant_server.post(CHAT, {"model": MODEL_NAME, "messages": HELLO}, headers={"Authorization": "Bearer sk-alice"})
    assert_error(r, 401, "invalid_api_key")


def test_auth_comes_before_the_body(tenant_server):
    # An unauthenticated client learns nothing about its body, even a malformed one.
    r = requests.post(tenant_server.url + CHAT, data="{", timeout=10)
    assert_error(r, 401, "invalid_api_key")


def test_valid_key_works(tenant_server):
    client = tenant_server.client_for(TENANT_KEYS["bob"])
    r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=1, temperature=0)
    assert r.usage.completion_tokens <= 1
