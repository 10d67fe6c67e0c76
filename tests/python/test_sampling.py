"""Penalties, logit_bias and min_p through the official client: each changes the tokens
exactly as its definition says, computed here from the model's own log-probabilities
(which the server reports before any adjustment), and a field the server does not honour
is refused by name, never ignored."""

import json
from collections import Counter

import openai
import pytest

from conftest import MODEL_NAME

# Invites repetition, so the penalties have something to act on.
PROMPT = [{"role": "user", "content": "Write the word banana again and again, separated by commas."}]
CHAT = "/v1/chat/completions"


def steps(server, n=24, **extra):
    """A greedy answer's tokens, each with its 20 most likely alternatives."""
    known = {k: extra.pop(k) for k in ("frequency_penalty", "presence_penalty", "logit_bias", "seed") if k in extra}
    r = server.client.chat.completions.create(
        model=MODEL_NAME,
        messages=PROMPT,
        temperature=extra.pop("temperature", 0),
        max_tokens=n,
        logprobs=True,
        top_logprobs=20,
        extra_body={"ignore_eos": True, **extra},
        **known,
    )
    return r.choices[0].logprobs.content


def ids(content):
    return [c.id for c in content]


def test_logit_bias_bans_and_forces_tokens(server):
    first = steps(server, n=1)[0]
    banned = first.id
    # Banning the greedy token picks the best of the rest, as the model scored them; the
    # reported log-probability is the model's, not the biased one.
    expected = max((a.logprob, -a.id, a.id) for a in first.top_logprobs if a.id != banned)[2]
    got = steps(server, n=1, logit_bias={str(banned): -100})[0]
    assert got.id == expected
    assert got.logprob == next(a.logprob for a in first.top_logprobs if a.id == expected)
    # +100 on an unlikely token makes every token that one.
    forced = first.top_logprobs[-1].id
    assert ids(steps(server, n=6, logit_bias={str(forced): 100})) == [forced] * 6


@pytest.mark.parametrize("frequency, presence", [(2.0, 0.0), (0.0, 1.5), (1.0, 1.0)])
def test_frequency_and_presence_penalties_follow_openais_definition(server, frequency, presence):
    plain = steps(server)
    got = steps(server, frequency_penalty=frequency, presence_penalty=presence)
    assert ids(got) != ids(plain), "the penalties changed nothing"
    counts = Counter()
    checked = 0
    for step in got:
        scored = sorted(
            ((a.logprob - counts[a.id] * frequency - (counts[a.id] > 0) * presence, a.id) for a in step.top_logprobs),
            reverse=True,
        )
        # A token outside the 20 scores at most the 20th's log-probability (the penalties
        # only lower scores); where the best penalized score is above it and clear of the
        # second by more than rounding, it is the token greedy decoding must pick.
        floor = min(a.logprob for a in step.top_logprobs)
        if scored[0][0] > floor and scored[0][0] - scored[1][0] > 1e-3:
            assert step.id == scored[0][1], (counts, scored[:3])
            checked += 1
        counts[step.id] += 1
    assert checked >= 0.75 * len(got), f"only {checked} of {len(got)} steps were decisive"


def test_repetition_penalty_and_its_window(server):
    plain = ids(steps(server))
    for name in ("repetition_penalty", "repeat_penalty"):
        assert ids(steps(server, **{name: 1.5})) != plain, name
    # A window of 0 tokens penalizes nothing; both names are one setting.
    assert ids(steps(server, repeat_penalty=1.5, repeat_last_n=0)) == plain
    assert ids(steps(server, repeat_penalty=1.5)) == ids(steps(server, repetition_penalty=1.5))


def test_min_p_of_one_is_greedy_and_seeded_choices_reproduce(server):
    plain = ids(steps(server))
    # Only tokens as likely as the most likely survive: sampling becomes greedy.
    assert ids(steps(server, temperature=1.0, seed=7, min_p=1.0)) == plain
    a = ids(steps(server, temperature=1.0, seed=7, min_p=0.05, frequency_penalty=0.5))
    assert a == ids(steps(server, temperature=1.0, seed=7, min_p=0.05, frequency_penalty=0.5))


def test_streamed_and_whole_answers_agree_under_penalties(server):
    kw = dict(
        model=MODEL_NAME,
        messages=PROMPT,
        temperature=0.8,
        seed=3,
        max_tokens=24,
        frequency_penalty=0.7,
        presence_penalty=0.3,
        logit_bias={"28": -5},
        extra_body={"repeat_penalty": 1.2, "min_p": 0.02, "ignore_eos": True},
    )
    whole = server.client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or "" for c in server.client.chat.completions.create(stream=True, **kw) if c.choices
    )
    assert streamed == whole


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("grammar", 'root ::= "yes" | "no"', "grammar"),
        ("json_schema", {"type": "object"}, "json_schema"),
        ("mirostat", 2, "mirostat"),
        ("structured_outputs", {"choice": ["a", "b"]}, "structured_outputs"),
    ],
)
def test_a_field_not_honoured_is_refused_by_name(server, field, value, param):
    body = {"model": MODEL_NAME, "messages": PROMPT, field: value}
    r = server.post(CHAT, data=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("unsupported_parameter", param)
    assert param in err["message"]


def test_bad_penalties_and_bias_are_400s_naming_them(server):
    for extra, param in [
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"min_p": -0.1}, "min_p"),
        ({"repeat_penalty": 0}, "repeat_penalty"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            server.client.chat.completions.create(model=MODEL_NAME, messages=PROMPT, max_tokens=1, extra_body=extra)
        assert (e.value.code, e.value.param) == ("invalid_value", param), extra
