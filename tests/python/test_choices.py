"""`n` choices (issue 21) with the official `openai` client: each choice is seeded from the
request's seed (choice 0 with the seed itself, so it is the n = 1 answer), the same request
gives the same choices again, usage counts the prompt once, streamed choices add up to the
whole ones, and the prompt is computed once: the other choices take its full pages from
the domain's prefix cache. With KVWARDEN_DEPLOYMENT=cluster, all of it through the router."""

import json

import pytest
import requests

from conftest import MODEL_NAME

QUESTION = [{"role": "user", "content": "Write one sentence about the sea."}]
# Long enough for several full KV pages (16 tokens each).
LONG = [{"role": "user", "content": "Tell me a story. " + " ".join(f"word{i}" for i in range(120))}]


def choice_seed(seed: int, choice: int) -> int:
    """The server's seed of choice `choice` (SplitMix64 from the request's), as a signed
    64-bit seed."""
    if choice == 0:
        return seed
    m = (1 << 64) - 1
    z = (seed + choice * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    z ^= z >> 31
    return z - (1 << 64) if z >= 1 << 63 else z


def chat(server, **kw):
    return server.client.chat.completions.create(model=MODEL_NAME, **kw)


def test_n_choices_are_seeded_reproducible_and_counted_once(server):
    kw = dict(messages=QUESTION, n=3, seed=11, temperature=1.0, max_tokens=24, logprobs=True)
    r = chat(server, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert chat(server, **kw).choices[0].message.content == texts[0]
    again = [c.message.content for c in chat(server, **kw).choices]
    assert again == texts
    assert len(set(texts)) > 1, texts
    one = chat(server, messages=QUESTION, seed=11, temperature=1.0, max_tokens=24, logprobs=True)
    assert one.choices[0].message.content == texts[0]
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_choices_add_up_to_the_whole_ones(server):
    kw = dict(messages=QUESTION, n=2, seed=5, temperature=0.8, max_tokens=16)
    whole = chat(server, **kw)
    content, finish, done = {}, {}, 0
    with requests.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL_NAME, "stream": True, **kw},
        headers={"Authorization": f"Bearer {server.api_key}"},
        stream=True,
        timeout=60,
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done += 1
                continue
            for c in json.loads(data)["choices"]:
                content[c["index"]] = content.get(c["index"], "") + (c["delta"].get("content") or "")
                if c["finish_reason"]:
                    finish[c["index"]] = c["finish_reason"]
    assert done == 1
    assert content == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}


def test_completions_take_n_too(server):
    r = server.client.completions.create(
        model=MODEL_NAME, prompt="The sea is", n=2, seed=3, temperature=1.0, max_tokens=12
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert all(isinstance(c.text, str) for c in r.choices)


def test_the_prompt_is_computed_once_and_shared_read_only(server):
    before = server.metrics().get("kvwarden_cached_prompt_tokens_total", 0)
    r = chat(server, messages=LONG, n=3, seed=1, temperature=1.0, max_tokens=4, extra_body={"cache_salt": "choices-once"})
    after = server.metrics().get("kvwarden_cached_prompt_tokens_total", 0)
    full_pages = r.usage.prompt_tokens // 16 * 16
    assert full_pages >= 128
    # Choices 1 and 2 each took every full page of the prompt from the cache.
    assert after - before >= 2 * full_pages, (before, after, r.usage)
    # And a choice that read the shared pages answers as if it had computed them: choice 2
    # alone, with its own seed, under a salt nothing is cached for.
    alone = chat(server, messages=LONG, n=1, seed=choice_seed(1, 2), temperature=1.0, max_tokens=4,
                 logprobs=True, extra_body={"cache_salt": "choices-fresh"})
    assert alone.usage.prompt_tokens_details.cached_tokens == 0
    assert alone.choices[0].message.content == r.choices[2].message.content


def test_forced_tool_calls_hold_in_every_choice(server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"], "additionalProperties": False}}}]
    r = chat(server, messages=QUESTION, n=2, seed=2, temperature=0.7, max_tokens=60, tools=tools,
             tool_choice="required", parallel_tool_calls=False)
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather"
        assert set(json.loads(call.function.arguments)) == {"city"}
    assert r.choices[0].message.tool_calls[0].id != r.choices[1].message.tool_calls[0].id


@pytest.mark.parametrize("n", [0, 17, "2"])
def test_n_out_of_range_is_a_400(server, n):
    r = server.post("/v1/chat/completions", {"model": MODEL_NAME, "messages": QUESTION, "n": n})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "n"
