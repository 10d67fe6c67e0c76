"""Structured outputs (issue 21): a constrained answer that ends with `stop` always
validates, streamed and not; every shape clients send (OpenAI's response_format, llama.cpp's
json_schema and grammar, vLLM's structured_outputs) is honoured on both endpoints; bad and
hostile constraints are 400s naming their field. With KVWARDEN_DEPLOYMENT=cluster, all of it
through the router, where the prefill node samples the first token under the mask and the
decode node compiles the constraint again and checks that token."""

import enum
import json
import re
from typing import Annotated, List, Optional

import openai
import pytest
from pydantic import BaseModel, Field, ValidationError

from conftest import MODEL_NAME

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class Colour(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=16)
    zip_code: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    favourite: Colour
    address: Address
    nicknames: List[Annotated[str, Field(max_length=10)]] = Field(max_length=3)
    email: Optional[Annotated[str, Field(max_length=24)]] = None


ASK = [{"role": "user", "content": "Invent a person: name, age, favourite colour, address, nicknames."}]


def test_parse_returns_the_pydantic_object(server):
    """Nested objects, an array, an enum, `$ref`s (pydantic's $defs) and an optional field,
    through the official client's parse(), greedy and seeded."""
    for kw in [dict(temperature=0), dict(temperature=0.9, seed=5), dict(temperature=1.0, seed=11)]:
        r = server.client.chat.completions.parse(
            model=MODEL_NAME, messages=ASK, response_format=Person, max_tokens=300, **kw
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (kw, choice.message.content)
        person = choice.message.parsed
        assert isinstance(person, Person) and isinstance(person.address, Address), choice.message.content
        assert person.favourite in Colour
    assert "$ref" in json.dumps(openai.lib._pydantic.to_strict_json_schema(Person))


def schema_request(stream, **kw):
    return dict(
        model=MODEL_NAME,
        messages=ASK,
        max_tokens=300,
        stream=stream,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "strict": True, "schema": Person.model_json_schema()},
        },
        **kw,
    )


@pytest.mark.parametrize("kw", [dict(temperature=0), dict(temperature=0.8, seed=42)])
def test_streamed_and_whole_answers_are_the_same_and_validate(server, kw):
    whole = server.client.chat.completions.create(**schema_request(False, **kw))
    chunks = list(server.client.chat.completions.create(**schema_request(True, **kw)))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"] == [whole.choices[0].finish_reason]
    Person.model_validate_json(streamed)


def test_every_answer_that_ends_with_stop_validates(server):
    """Hot sampling over many seeds: a small model's worst; whatever ends `stop` validates,
    and whatever does not validate ended `length`."""
    stopped = 0
    for seed in range(8):
        r = server.client.chat.completions.create(**schema_request(False, temperature=1.3, seed=seed))
        c = r.choices[0]
        if c.finish_reason == "stop":
            Person.model_validate_json(c.message.content)
            stopped += 1
        else:
            assert c.finish_reason == "length", c
    assert stopped >= 4, stopped


def test_an_answer_cut_by_max_tokens_says_length(server):
    r = server.client.chat.completions.create(**dict(schema_request(False, temperature=0), max_tokens=4))
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 4
    with pytest.raises(ValidationError):
        Person.model_validate_json(c.message.content)


def post(server, path, body):
    r = server.post(path, {"model": MODEL_NAME, **body})
    return r


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_json_object_answers_parse_on_both_endpoints(server, path):
    body = {"max_tokens": 200, "temperature": 0, "response_format": {"type": "json_object"}}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "Describe a cat as JSON."}]
    else:
        body["prompt"] = "A cat, described as JSON:"
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    text = c["message"]["content"] if path == CHAT else c["text"]
    if c["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict), text
    else:
        assert c["finish_reason"] == "length" and text.startswith("{"), c


@pytest.mark.parametrize(
    "extra, check",
    [
        # llama.cpp's GBNF.
        ({"grammar": 'root ::= " " ("yes" | "no") ", because " [a-z ]{3,30} "."'},
         lambda t: re.fullmatch(r" (yes|no), because [a-z ]{3,30}\.", t)),
        # llama.cpp's Lark for llguidance.
        ({"grammar": '%llguidance {}\nstart: " " ("red" | "green")'}, lambda t: t in (" red", " green")),
        # vLLM's shapes.
        ({"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}}, lambda t: re.fullmatch(r" [0-9]{3}-[0-9]{4}", t)),
        ({"structured_outputs": {"choice": [" Paris", " Lyon", " Nice"]}}, lambda t: t in (" Paris", " Lyon", " Nice")),
        ({"structured_outputs": {"grammar": 'root ::= " " [A-Z] [a-z]{1,12}'}}, lambda t: re.fullmatch(r" [A-Z][a-z]{1,12}", t)),
        ({"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}}},
         lambda t: isinstance(json.loads(t), list) and len(json.loads(t)) <= 3),
        # llama.cpp's json_schema.
        ({"json_schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                          "additionalProperties": False}},
         lambda t: set(json.loads(t)) == {"ok"}),
    ],
)
def test_completions_honour_every_shape(server, extra, check):
    for kw in [{"temperature": 0}, {"temperature": 1.0, "seed": 3}]:
        r = post(server, COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 40, **kw, **extra})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "stop", (extra, c)
        assert check(c["text"]), (extra, c["text"])


def test_the_first_token_is_constrained_too(server):
    """The model's own first choice here is not a digit: the mask decides from token one
    (and, split, on the prefill node)."""
    free = post(server, COMPLETIONS, {"prompt": "Hello, my name is", "max_tokens": 1, "temperature": 0}).json()
    assert not free["choices"][0]["text"].strip().isdigit()
    r = post(server, COMPLETIONS, {"prompt": "Hello, my name is", "max_tokens": 8, "temperature": 0,
                                   "structured_outputs": {"regex": "[0-9]{2}"}})
    assert re.fullmatch("[0-9]{2}", r.json()["choices"][0]["text"]), r.text


@pytest.mark.parametrize(
    "extra, param, code, says",
    [
        ({"json_schema": {"type": "no-such-type"}}, "json_schema", "invalid_value", "no-such-type"),
        ({"json_schema": [1]}, "json_schema", "invalid_value", "schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                       "extra": 1}}},
         "response_format.json_schema.extra", "unsupported_parameter", "extra"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "unsupported_parameter", "yaml"),
        ({"grammar": "root ::= undefined-rule"}, "grammar", "invalid_value", "never defined"),
        ({"grammar": "root ::= (((((\"x\""}, "grammar", "invalid_value", "expected ')'"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "invalid_value", "regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "invalid_value", "one of"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
         "unsupported_parameter", "whitespace_pattern"),
        ({"json_schema": {"type": "object"}, "grammar": 'root ::= "x"'}, "grammar", "invalid_value", "give one"),
        ({"json_schema": {"type": "object"}, "stop": ["}"]}, "stop", "invalid_value", "stop"),
        ({"json_schema": {"type": "object"}, "ignore_eos": True}, "ignore_eos", "invalid_value", "ignore_eos"),
        # Over the 128 KiB limit: refused before anything is compiled.
        ({"json_schema": {"enum": [f"value {i}" for i in range(20000)]}}, "json_schema", "invalid_value",
         "at most 131072 bytes"),
        ({"structured_outputs": {"choice": [str(i) for i in range(1025)]}}, "structured_outputs",
         "invalid_value", "at most 1024"),
    ],
)
def test_bad_and_hostile_constraints_are_400s_naming_their_field(server, extra, param, code, says):
    for path, body in [(CHAT, {"messages": ASK}), (COMPLETIONS, {"prompt": "x"})]:
        r = post(server, path, {"max_tokens": 4, **body, **extra})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (param, code), err
        assert says in err["message"], err


def test_hostile_but_legal_constraints_cost_bounded_work_and_health_stays_up(server):
    """A deeply nested schema, a large enum and an exploding regex, each within the size
    limit: each answers (200 or 400) and the server stays healthy."""
    nested = {"type": "string"}
    while len(json.dumps(nested)) < 60_000:
        nested = {"type": "object", "properties": {"a": nested, "b": nested}}
    for extra in [
        {"json_schema": nested},
        {"json_schema": {"enum": [f"value {i}" for i in range(5000)]}},
        {"structured_outputs": {"regex": "(a|b)*a(a|b){300}"}},
        {"structured_outputs": {"regex": "(x{1,1000}){1,1000}"}},
    ]:
        r = post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 16, "temperature": 0, **extra})
        assert r.status_code in (200, 400), r.text
    assert server.post("/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_masks_are_computed_and_counted(server):
    before = server.metrics().get("kvwarden_constrained_tokens_total", 0)
    r = post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 16, "temperature": 0,
                                   "structured_outputs": {"regex": "[a-z]{12}"}}).json()
    after = server.metrics().get("kvwarden_constrained_tokens_total", 0)
    # One mask per sampled token (split: the first on the prefill node, the rest on the
    # decode node), and the answer is complete without an end-of-sequence step.
    assert after - before == r["usage"]["completion_tokens"] >= 2, (before, after, r)
