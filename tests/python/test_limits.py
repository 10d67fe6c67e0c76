"""The advertised context is enforced exactly, with max_tokens counted, and a refused
request never produces a 200 or tokens."""

import json
import signal
import subprocess
import time

import openai
import pytest
import requests

from conftest import BIN, MODEL, MODEL_NAME, ROOT, Server, require_binary

LIMIT = 64
def ids(n):
    # Token 260 is " the" in this vocabulary; any in-vocabulary id would do.
    return [260] * n


def test_models_advertises_the_limit(small_server):
    body = requests.get(small_server.url + "/v1/models", timeout=10).json()
    assert body["data"][0]["max_model_len"] == LIMIT


def test_limit_minus_one_plus_one_fits(small_server):
    r = small_server.client.completions.create(
        model=MODEL_NAME, prompt=ids(LIMIT - 1), max_tokens=1, temperature=0
    )
    assert r.usage.prompt_tokens == LIMIT - 1
    assert r.usage.completion_tokens <= 1
    assert r.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("prompt_len", [LIMIT, LIMIT + 1, 10 * LIMIT])
def test_over_the_limit_is_400(small_server, prompt_len):
    with pytest.raises(openai.BadRequestError) as e:
        small_server.client.completions.create(
            model=MODEL_NAME, prompt=ids(prompt_len), max_tokens=1, temperature=0
        )
    err = e.value.body
    assert e.value.status_code == 400
    assert err["code"] == "context_length_exceeded"
    assert err["param"] == "prompt"
    assert err["type"] == "invalid_request_error"
    msg = err["message"]
    assert f"maximum context length is {LIMIT} tokens" in msg, msg
    assert f"{prompt_len + 1} tokens" in msg and f"{prompt_len} in the prompt" in msg, msg


def test_max_tokens_is_counted(small_server):
    # A short prompt, but prompt + max_tokens is one over.
    with pytest.raises(openai.BadRequestError) as e:
        small_server.client.completions.create(model=MODEL_NAME, prompt=ids(10), max_tokens=LIMIT - 9)
    assert e.value.code == "context_length_exceeded"
    # The prompt fits alone: it is max_tokens that does not.
    assert e.value.body["param"] == "max_tokens"
    r = small_server.client.completions.create(
        model=MODEL_NAME, prompt=ids(10), max_tokens=LIMIT - 10, temperature=0, stop=["."]
    )
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= LIMIT


def test_default_max_tokens_is_the_remaining_context(small_server):
    r = small_server.client.completions.create(model=MODEL_NAME, prompt=ids(LIMIT - 2), temperature=0)
    assert r.usage.completion_tokens <= 2
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 2


def test_chat_over_the_limit_names_messages(small_server):
    long = "word " * 100
    with pytest.raises(openai.BadRequestError) as e:
        small_server.client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": long}], max_tokens=1
        )
    assert e.value.code == "context_length_exceeded"
    assert e.value.body["param"] == "messages"
    assert f"{LIMIT} tokens" in e.value.body["message"]


def test_streaming_over_the_limit_fails_before_the_stream(small_server):
    r = small_server.post(
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": ids(LIMIT + 1), "max_tokens": 1, "stream": True},
        stream=True,
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        for _ in small_server.client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "word " * 100}], stream=True
        ):
            pytest.fail("an over-length stream produced a chunk")


def test_rejections_never_reach_the_engine(small_server):
    before = small_server.metrics()
    for n in (LIMIT, LIMIT + 5):
        small_server.post("/v1/completions", {"model": MODEL_NAME, "prompt": ids(n), "max_tokens": 1})
    after = small_server.metrics()
    key = 'kvwarden_rejections_total{reason="context_length_exceeded"}'
    assert after[key] == before.get(key, 0) + 2
    assert after["kvwarden_prompt_tokens_total"] == before["kvwarden_prompt_tokens_total"]
    assert after["kvwarden_engine_steps_total"] == before["kvwarden_engine_steps_total"]


def test_a_hundred_thousand_empty_messages_are_refused_at_once(server):
    """3 MB of empty messages used to be rendered with a quadratic substitution (about a
    minute of CPU) before admission refused them; the count alone rules them out."""
    body = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": ""}] * 100_000})
    # A liveness timeout, generous for a refusal that takes no rendering at all.
    r = requests.post(
        server.url + "/v1/chat/completions", data=body,
        headers={"Content-Type": "application/json"}, timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "messages"), err


def test_the_message_count_is_checked_before_any_message(server):
    messages = [{"role": "user", "content": ""}] * 4096 + [{"role": "nobody", "content": ""}]
    r = server.post("/v1/chat/completions", {"model": MODEL_NAME, "messages": messages})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_a_full_queue_is_429_with_retry_after(make_server):
    s = make_server(
        "--kv-pool-tokens", "1024", "--max-running", "1", "--max-waiting", "0", name="queue"
    )
    stream = s.client.completions.create(
        model=MODEL_NAME, prompt="Tell me a long story.", max_tokens=900, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )
    for _ in stream:
        break  # it runs, and holds the engine's only place
    r = s.post("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 429, r.text
    assert r.headers["Retry-After"] == "1"
    err = r.json()["error"]
    assert err["code"] == "queue_full" and err["message"], err
    with pytest.raises(openai.RateLimitError):
        s.client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
    stream.close()
    # Liveness: once the first request is gone, its place is free again.
    deadline = time.monotonic() + 60
    while True:
        r = s.post("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})
        if r.status_code != 429 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert r.status_code == 200, r.text


def run_serve(*args, timeout=60):
    require_binary()
    return subprocess.run(
        [str(BIN), "serve", "--model", str(MODEL), "--port", "0", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_startup_refuses_context_larger_than_pool():
    r = run_serve("--max-context", 8192, "--kv-pool-tokens", 4096)
    assert r.returncode != 0
    assert "8192" in r.stderr and "4096" in r.stderr, r.stderr
    assert "listening" not in r.stderr


def test_startup_refuses_a_bad_key_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("only-a-key\n")
    r = run_serve("--api-keys", keys, "--kv-pool-tokens", 256)
    assert r.returncode != 0
    assert "line 1" in r.stderr, r.stderr


def test_sigterm_shuts_down_cleanly(tmp_path):
    s = Server(["--kv-pool-tokens", "256"], tmp_path / "stderr.log")
    try:
        r = s.client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, temperature=0)
        assert r.choices[0].text is not None
    finally:
        code = s.stop()
    assert code == 0, s.stderr()


def test_shutdown_mid_stream_sends_one_error_event(tmp_path):
    s = Server(["--kv-pool-tokens", "4096"], tmp_path / "stderr.log")
    try:
        r = s.post(
            "/v1/chat/completions",
            {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "Tell me a very long story."}],
                "max_tokens": 2000,
                "temperature": 0.8,
                "stream": True,
                "ignore_eos": True,
            },
            stream=True,
        )
        assert r.status_code == 200
        events = []
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                events.append(line[len(b"data: "):])
                if len(events) == 3:
                    s.proc.send_signal(signal.SIGTERM)
    finally:
        code = s.stop()
    assert code == 0, s.stderr()
    assert b"[DONE]" not in events, "a failed stream must not look complete"
    last = json.loads(events[-1])
    assert last["error"]["code"] == "service_unavailable", last
    assert all("error" not in json.loads(e) for e in events[:-1])
