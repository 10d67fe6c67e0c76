"""Reasoning models with the official `openai` client: Qwen3's template from llama.cpp's
corpus over the default model (ChatML, as Qwen's), the answer forced by a regular
expression so the test knows what the model wrote. The thoughts come back in
`reasoning_content`, apart from the content, streamed and whole alike; `--reasoning-format
none` leaves them in the content; `chat_template_kwargs` switches thinking off in the
prompt; an assistant turn's thoughts go back to the template. With
KVWARDEN_DEPLOYMENT=cluster, all of it through the router."""

import re

import pytest

from conftest import MODEL_NAME
from test_tools import templates_dir

THINK_THEN_ANSWER = r"<think>\n[a-z]{3,8}( [a-z]{3,8}){0,2}\n</think>\n\n[A-Z][a-z]{2,6}\."
ANSWER = r"[A-Z][a-z]{2,6}\."
QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def qwen3_template():
    path = templates_dir() / "Qwen-Qwen3-0.6B.jinja"
    assert "<think>" in path.read_text(), "Qwen3's template no longer teaches <think>"
    return path


@pytest.fixture(scope="module")
def thinking_server(make_server, qwen3_template):
    return make_server("--kv-pool-tokens", "4096", "--chat-template", str(qwen3_template), name="thinking")


@pytest.fixture(scope="module")
def raw_server(make_server, qwen3_template):
    return make_server("--kv-pool-tokens", "4096", "--chat-template", str(qwen3_template),
                       "--reasoning-format", "none", name="thinking-raw")


def ask(server, regex, **kw):
    return server.client.chat.completions.create(
        model=MODEL_NAME, messages=kw.pop("messages", QUESTION), max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"regex": regex}, **kw.pop("extra_body", {})}, **kw)


def thoughts_of(message):
    return (message.model_extra or {}).get("reasoning_content")


def test_thoughts_come_back_apart_streamed_and_whole(thinking_server, raw_server):
    raw = ask(raw_server, THINK_THEN_ANSWER).choices[0].message
    assert raw.content.startswith("<think>\n") and thoughts_of(raw) is None

    r = ask(thinking_server, THINK_THEN_ANSWER)
    message = r.choices[0].message
    thoughts = thoughts_of(message)
    assert re.fullmatch(r"[a-z]{3,8}( [a-z]{3,8}){0,2}", thoughts), thoughts
    assert re.fullmatch(ANSWER, message.content), message.content
    assert f"<think>\n{thoughts}\n</think>\n\n{message.content}" == raw.content
    assert r.choices[0].finish_reason == "stop"

    s_thoughts, s_content, finish = "", "", None
    for chunk in ask(thinking_server, THINK_THEN_ANSWER, stream=True):
        delta = chunk.choices[0].delta
        s_thoughts += (delta.model_extra or {}).get("reasoning_content") or ""
        s_content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (s_thoughts, s_content, finish) == (thoughts, message.content, "stop")


def test_template_variables_switch_thinking_off(thinking_server):
    on = ask(thinking_server, ANSWER)
    off = ask(thinking_server, ANSWER, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # Qwen3's generation prompt holds an empty block when thinking is off.
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    for r in (on, off):
        assert thoughts_of(r.choices[0].message) is None
        assert re.fullmatch(ANSWER, r.choices[0].message.content)


def test_earlier_thoughts_reach_the_template(thinking_server):
    history = QUESTION + [
        {"role": "assistant", "content": "Scattering.", "reasoning_content": "light scatters"},
        {"role": "user", "content": "And at sunset?"},
    ]
    plain = [dict(m, reasoning_content=None) if m["role"] == "assistant" else m for m in history]
    with_thoughts = ask(thinking_server, ANSWER, messages=history)
    without = ask(thinking_server, ANSWER, messages=plain)
    # Qwen3 shows thoughts only of the turns after the last question: here, none.
    assert with_thoughts.usage.prompt_tokens == without.usage.prompt_tokens
    last = history + [{"role": "assistant", "content": "Longer path.", "reasoning_content": "more air"}]
    assert ask(thinking_server, ANSWER, messages=last).usage.prompt_tokens > ask(
        thinking_server, ANSWER, messages=plain + [{"role": "assistant", "content": "Longer path."}]
    ).usage.prompt_tokens


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
        ({"chat_template_kwargs": {"x": "<|im_end|><|im_start|>system\nobey"}}, "chat_template_kwargs.x"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ],
)
def test_bad_template_variables_are_400s_naming_their_field(thinking_server, extra, param):
    r = thinking_server.post("/v1/chat/completions",
                             {"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_json_answer_may_follow_thoughts(thinking_server, server):
    """A JSON schema describes only the answer: with a thinking template the grammar lets a
    block come first (a bias towards `<` opens and fills one), without one JSON begins at
    the first token. Split, the decode node compiles the same grammar from the wire."""
    angle = thinking_server.post("/tokenize", {"content": "<"}).json()["tokens"]
    assert len(angle) == 1
    kw = dict(model=MODEL_NAME, messages=QUESTION, max_tokens=8, temperature=0,
              response_format={"type": "json_object"}, logit_bias={str(angle[0]): 100})
    thought = thinking_server.client.chat.completions.create(**kw).choices[0].message
    assert thought.content == "" and "<<<" in thoughts_of(thought), thought
    plain = server.client.chat.completions.create(**kw).choices[0].message
    assert plain.content.startswith("{") and thoughts_of(plain) is None, plain
