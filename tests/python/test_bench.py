"""`kvwarden bench serve` against kvwarden itself: the report counts what was asked for.
Timings are never asserted, only their consistency."""

import json
import subprocess

import pytest

from conftest import BIN, ROOT


def bench(server, *args):
    """Runs `kvwarden bench serve` with its JSON report on stdout; returns (exit, report or
    None, stderr)."""
    out = subprocess.run(
        [str(BIN), "bench", "serve", "--base-url", server.url, "--api-key", server.api_key,
         "--json", "-", *[str(a) for a in args]],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    try:
        report = json.loads(out.stdout)
    except json.JSONDecodeError:
        report = None
    return out.returncode, report, out.stderr


def assert_ordered(dist, what):
    assert dist is not None, f"no {what} samples"
    assert dist["p50"] <= dist["p90"] <= dist["p99"] <= dist["max"], (what, dist)
    assert dist["mean"] > 0, (what, dist)


def test_closed_loop_counts_every_token(server):
    requests, max_tokens, prompt = 6, 5, 12
    code, r, err = bench(
        server, "--num-requests", requests, "--concurrency", 3, "--prompt-tokens", prompt,
        "--max-tokens", max_tokens, "--ignore-eos", "--seed", 4,
    )
    assert code == 0, err
    assert (r["completed"], r["failed"], r["failures"]) == (requests, 0, {})
    # ignore_eos: every request generates exactly max_tokens, as the server's usage says.
    assert r["output_tokens"] == requests * max_tokens
    assert r["output_counted_by"] == "usage"
    assert r["prompt_tokens"] == requests * prompt
    for what in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert_ordered(r[what], what)
    assert r["ttft_ms"]["samples"] == r["e2e_ms"]["samples"] == requests
    # One gap between each pair of successive content chunks of a request.
    assert r["itl_ms"]["samples"] <= requests * (max_tokens - 1)
    assert r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"]
    assert r["workload"]["concurrency"] == 3


def test_open_loop_with_text_prompts(server):
    code, r, err = bench(
        server, "--num-requests", 4, "--request-rate", 50, "--prompt-words", 8,
        "--max-tokens", 3, "--ignore-eos",
    )
    assert code == 0, err
    assert (r["completed"], r["failed"], r["output_tokens"]) == (4, 0, 12)
    assert r["workload"]["request_rate"] == 50
    assert_ordered(r["e2e_ms"], "e2e_ms")


def test_failures_are_counted_by_status_and_exit_nonzero(server):
    # The default fixture advertises 4096 tokens: these prompts are refused with 400.
    code, r, err = bench(server, "--num-requests", 2, "--prompt-tokens", 5000, "--max-tokens", 2)
    assert code != 0
    assert (r["completed"], r["failed"], r["failures"]) == (0, 2, {"HTTP 400": 2})
    assert "maximum context length" in r["first_errors"]["HTTP 400"]
    assert "2 of 2 requests failed" in err


def test_an_unreachable_server_is_a_clear_error():
    class Nowhere:
        url = "http://127.0.0.1:9"
        api_key = "unused"

    code, r, err = bench(Nowhere, "--num-requests", 1)
    assert code != 0 and r is None
    assert "cannot reach http://127.0.0.1:9" in err and "panicked" not in err


def test_a_wrong_key_is_a_clear_error_before_any_load(tenant_server):
    class WrongKey:
        url = tenant_server.url
        api_key = "sk-not-a-tenant"

    code, r, err = bench(WrongKey, "--num-requests", 1)
    assert code != 0 and r is None
    assert "refused the request with HTTP 401" in err and "panicked" not in err


WEATHER_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}]


def test_tool_requests_go_to_chat_and_their_calls_are_counted(server, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(WEATHER_TOOL))
    requests = 4
    code, r, err = bench(
        server, "--chat", "--prompt-words", 12, "--tools", tools, "--tool-choice", "get_weather",
        "--num-requests", requests, "--concurrency", 2, "--max-tokens", 64,
    )
    assert code == 0, err
    w = r["workload"]
    assert (w["endpoint"], w["tools"], w["tool_choice"]) == ("chat", str(tools), "get_weather")
    assert (r["completed"], r["failed"]) == (requests, 0)
    # A named function is one call, whose arguments are bounded well inside 64 tokens.
    assert r["tool_calls"] == requests, r
    assert r["output_counted_by"] == "usage"
    # A call's deltas are output: every request has a first-token time.
    assert r["ttft_ms"]["samples"] == requests
    assert 0 < r["output_tokens"] < requests * 64


def test_the_whole_story_tool_runs_to_max_tokens(server):
    # bench/serve.py's (f): the forced call of bench/story-tool.json never ends before
    # max_tokens, so every answer costs max_tokens of constrained decoding.
    code, r, err = bench(
        server, "--chat", "--prompt-words", 12, "--tools", ROOT / "bench" / "story-tool.json",
        "--num-requests", 2, "--max-tokens", 24,
    )
    assert code == 0, err
    assert r["workload"]["tool_choice"] == "required"
    assert (r["completed"], r["output_tokens"], r["tool_calls"]) == (2, 48, 0)


@pytest.mark.parametrize("args,message", [
    (["--chat", "--num-requests", 1], "--chat sends text: give --prompt-words"),
    (["--chat", "--prompt-words", 3, "--tools", "{tools}", "--tool-choice", "nope"],
     "--tool-choice nope: no such function"),
    (["--chat", "--prompt-words", 3, "--tools", "{empty}"], "not a non-empty JSON array of tools"),
])
def test_bad_tool_arguments_are_clear_errors(server, tmp_path, args, message):
    (tmp_path / "tools.json").write_text(json.dumps(WEATHER_TOOL))
    (tmp_path / "empty.json").write_text("[]")
    args = [str(a).format(tools=tmp_path / "tools.json", empty=tmp_path / "empty.json") for a in args]
    code, r, err = bench(server, *args)
    assert code != 0 and r is None
    assert message in err and "panicked" not in err
