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


def test_stop_token_ids_end_and_min_tokens_hold_the_end_off(server):
    """A stop token ends the answer before it (also past ignore_eos); min_tokens keeps every
    ending token, forced here by a bias, off until the answer has that many."""
    free = ids(steps(server, n=8))
    stop = free[3]
    r = server.client.chat.completions.create(
        model=MODEL_NAME, messages=PROMPT, temperature=0, max_tokens=8, logprobs=True,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    assert ids(r.choices[0].logprobs.content) == free[:free.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    eos = 2  # the default model's <|im_end|>
    for min_tokens in (0, 5):
        r = server.client.chat.completions.create(
            model=MODEL_NAME, messages=PROMPT, temperature=0, max_tokens=8,
            logit_bias={str(eos): 100}, extra_body={"min_tokens": min_tokens})
        assert r.usage.completion_tokens == min_tokens, min_tokens
        assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("mirostat", 2, "mirostat"),
        ("guided_json", {"type": "object"}, "guided_json"),
        ("grammar_lazy", True, "grammar_lazy"),
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


# Every request field of llama.cpp's server (tools/server/server-schema.cpp in the
# llama-cpp-python 0.3.36 sdist), vLLM's OpenAI-compatible extensions and OpenAI's own
# chat parameters that kvwarden does not serve.
LLAMA_CPP_FIELDS = """adaptive_decay adaptive_target backend_sampling cache_prompt chat_format chat_parser
continue_final_message dry_allowed_length dry_base dry_multiplier dry_penalty_last_n dry_sequence_breakers
dynatemp_exponent dynatemp_range echo frequency_penalty generation_prompt grammar grammar_lazy grammar_triggers
ignore_eos include_usage json_schema logit_bias lora min_keep min_p mirostat mirostat_eta mirostat_tau
n_cache_reuse n_cmpl n_discard n_indent n_keep n_predict n_probs parse_tool_calls post_sampling_probs
presence_penalty preserved_tokens reasoning_budget_end_tags reasoning_budget_message reasoning_budget_start_tag
reasoning_budget_tokens reasoning_control reasoning_format repeat_last_n repeat_penalty response_fields
return_progress return_tokens samplers seed sse_ping_interval stop stream stream_options t_max_predict_ms
t_max_prompt_ms temperature timings_per_token top_k top_n_sigma top_p typical_p verbose xtc_probability
xtc_threshold""".split()
VLLM_FIELDS = """best_of use_beam_search length_penalty stop_token_ids include_stop_str_in_output
skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens prompt_logprobs allowed_token_ids
bad_words min_tokens guided_json guided_regex guided_choice guided_grammar guided_decoding_backend
structured_outputs add_generation_prompt add_special_tokens documents chat_template chat_template_kwargs
mm_processor_kwargs priority request_id return_tokens_as_token_ids kv_transfer_params vllm_xargs
repetition_penalty min_p top_k seed ignore_eos cache_salt""".split()
OPENAI_FIELDS = """store metadata modalities audio prediction reasoning_effort service_tier web_search_options
verbosity prompt_cache_key safety_identifier n tools tool_choice functions function_call parallel_tool_calls
response_format user""".split()
# What the server honours (README, "Request parameters"), with a valid value for each.
HONOURED = {
    "frequency_penalty": 0.1, "presence_penalty": 0.1, "logit_bias": {"5": 1}, "min_p": 0.1,
    "repeat_last_n": 8, "repeat_penalty": 1.1, "repetition_penalty": 1.1, "seed": 1,
    "stop": "zzz", "stream": False, "stream_options": {"include_usage": False}, "temperature": 0.5,
    "top_k": 5, "top_p": 0.9, "ignore_eos": True, "cache_salt": "s",
    # Structured outputs (tests/python/test_structured.py).
    "grammar": 'root ::= "yes" | "no"', "json_schema": {"type": "object"},
    "response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a", "b"]},
    # Several choices (tests/python/test_choices.py).
    "n": 2,
    # Tool calling (tests/python/test_tools.py).
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none",
    "parallel_tool_calls": True,
    # vLLM's end controls (test_stop_token_ids_end_and_min_tokens_hold_the_end_off) and
    # template variables (tests/python/test_reasoning.py).
    "stop_token_ids": [5], "min_tokens": 1, "chat_template_kwargs": {"enable_thinking": False},
    # Accepted without effect: the answer is the same either way.
    "cache_prompt": True, "user": "u1",
}


def test_every_documented_field_is_honoured_or_refused(server):
    ignored = []
    for field in sorted(set(LLAMA_CPP_FIELDS + VLLM_FIELDS + OPENAI_FIELDS)):
        body = {"model": MODEL_NAME, "messages": PROMPT, "max_tokens": 2, field: HONOURED.get(field, 2)}
        r = server.post(CHAT, data=json.dumps(body), headers={"Content-Type": "application/json"})
        if field in HONOURED:
            assert r.status_code == 200, (field, r.text)
        elif r.status_code == 200:
            ignored.append(field)
        else:
            assert r.status_code == 400, (field, r.text)
            assert r.json()["error"]["param"] == field, (field, r.text)
    assert not ignored, f"accepted and not honoured: {ignored}"
