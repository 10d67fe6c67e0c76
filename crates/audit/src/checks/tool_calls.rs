//! Check 8, tool-call validity: a chat request declaring two functions with
//! `tool_choice: "required"`, greedy, once whole and once streamed. A server that refuses
//! it (4xx) does not serve tool calling, which is reported, not failed; one that accepts
//! it must answer, both ways, with calls (finish reason `tool_calls`) that each name a
//! declared function and whose arguments validate against that function's schema, and the
//! streamed deltas joined must equal the whole answer's calls. Accepting `required` and
//! answering with text (whole, or run to max_tokens without anything a call could begin
//! with), or with a call the schema refuses, is a failure.

use oai_client::{Api, Prompt, ToolCallSeen};
use serde_json::{json, Value};

use crate::auditor::{Auditor, Planned};
use crate::record::Record;
use crate::report::{CheckName, CheckResult, Kind, Severity, Verdict};
use crate::text::clip;

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 24},
                    "unit": {"enum": ["celsius", "fahrenheit"]}
                },
                "required": ["city", "unit"],
                "additionalProperties": false
            }}},
        {"type": "function", "function": {
            "name": "get_time",
            "description": "The current time in a time zone.",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string", "maxLength": 16}},
                "required": ["timezone"],
                "additionalProperties": false
            }}}
    ])
}

/// Why `call` is not a valid call of one of [`tools`], or `None` when it is.
fn invalid(call: &ToolCallSeen) -> Option<String> {
    let args: Value = match serde_json::from_str(&call.arguments) {
        Ok(v) => v,
        Err(e) => return Some(format!("arguments are not JSON ({e})")),
    };
    let Some(a) = args.as_object() else {
        return Some("arguments are not a JSON object".into());
    };
    let short = |k: &str, max: usize| {
        a.get(k)
            .and_then(Value::as_str)
            .is_some_and(|s| s.chars().count() <= max)
    };
    let ok = match call.name.as_str() {
        "get_weather" => {
            a.len() == 2
                && short("city", 24)
                && ["celsius", "fahrenheit"]
                    .contains(&a.get("unit").and_then(Value::as_str).unwrap_or(""))
        }
        "get_time" => a.len() == 1 && short("timezone", 16),
        other => {
            return Some(format!(
                "a function that was not declared: {:?}",
                clip(other, 40)
            ))
        }
    };
    (!ok).then(|| {
        format!(
            "arguments {} do not validate against {}'s schema",
            clip(&call.arguments, 120),
            call.name
        )
    })
}

/// Whether text cut at max_tokens could be the start of a call in some family's syntax (a
/// JSON object, a Hermes tag, a Mistral or Llama marker).
fn could_hold_a_call(text: &str) -> bool {
    ["{", "<tool_call>", "[TOOL_CALLS]", "<|python_tag|>"]
        .iter()
        .any(|m| text.contains(m))
}

impl Auditor {
    pub(crate) async fn tool_calls(&mut self) -> CheckResult {
        let prompt = "What is the weather like in Paris right now?";
        let mut sent = Vec::new();
        for stream in [false, true] {
            let mut call = self.call(Api::Chat, Prompt::Text(prompt.into()), 0);
            call.stream = stream;
            call.max_tokens = call.max_tokens.max(160);
            call.extra.insert("tools".into(), tools());
            call.extra.insert("tool_choice".into(), json!("required"));
            call.extra
                .insert("parallel_tool_calls".into(), json!(false));
            let r = self
                .send_one(Planned {
                    tenant: 0,
                    kind: Kind::ToolCall,
                    call,
                    canary: None,
                    replay_of: None,
                })
                .await;
            sent.push(r);
        }
        let (result, findings) = judge(&sent);
        for (severity, request, message) in findings {
            self.find(CheckName::ToolCalls, severity, Some(request), message);
        }
        result
    }
}

/// The verdict on the whole and streamed answers, and its findings (severity, request,
/// message).
fn judge(sent: &[Record]) -> (CheckResult, Vec<(Severity, usize, String)>) {
    let mut findings = Vec::new();
    let mut find = |severity, request, message| findings.push((severity, request, message));
    let result = |verdict, summary: String| CheckResult {
        check: CheckName::ToolCalls,
        title: CheckName::ToolCalls.title(),
        verdict,
        summary,
    };
    let refused = sent
        .iter()
        .filter(|r| r.ex.status.is_some_and(|s| (400..500).contains(&s)))
        .count();
    if refused == sent.len() {
        let why = sent[0].ex.error_message.as_deref().unwrap_or("");
        return (
            result(
                Verdict::Skipped,
                format!(
                    "tool calling is not served (refused with a 4xx: {})",
                    clip(why, 160)
                ),
            ),
            Vec::new(),
        );
    }
    let (mut failures, mut judged, mut calls_seen) = (0, 0, 0);
    for r in sent {
        let how = if r.call.stream { "streamed" } else { "whole" };
        if !r.ex.succeeded() {
            failures += 1;
            find(
                Severity::Failure,
                r.id,
                format!("the {how} request was accepted by one path and refused or failed by the other (HTTP {:?})", r.ex.status),
            );
            continue;
        }
        match r.ex.finish_reason.as_deref() {
            // A call that began and was cut cannot be judged; prose with nothing a call
            // could start with shows the choice was ignored.
            Some("length") if r.ex.tool_calls.is_empty() && !could_hold_a_call(&r.ex.content) => {
                judged += 1;
                failures += 1;
                find(
                    Severity::Failure,
                    r.id,
                    format!(
                        "tool_choice \"required\" was accepted but the {how} answer ran to max_tokens without beginning a call: {}",
                        clip(&r.ex.content, 160)
                    ),
                );
            }
            Some("length") => find(
                Severity::Warning,
                r.id,
                format!("the {how} answer reached max_tokens: its call cannot be judged"),
            ),
            reason => {
                judged += 1;
                if r.ex.tool_calls.is_empty() {
                    failures += 1;
                    find(
                        Severity::Failure,
                        r.id,
                        format!(
                            "tool_choice \"required\" was accepted but the {how} answer made no call (finish {reason:?}): {}",
                            clip(&r.ex.content, 160)
                        ),
                    );
                    continue;
                }
                if reason != Some("tool_calls") {
                    find(
                        Severity::Warning,
                        r.id,
                        format!(
                            "the {how} answer made calls but ended with {reason:?}, not tool_calls"
                        ),
                    );
                }
                for c in &r.ex.tool_calls {
                    calls_seen += 1;
                    if let Some(why) = invalid(c) {
                        failures += 1;
                        find(
                            Severity::Failure,
                            r.id,
                            format!("an invalid call ({how}): {why}"),
                        );
                    }
                }
            }
        }
    }
    if let [whole, streamed] = sent {
        let parsed = |r: &Record| -> Vec<(String, Option<Value>)> {
            r.ex.tool_calls
                .iter()
                .map(|c| (c.name.clone(), serde_json::from_str(&c.arguments).ok()))
                .collect()
        };
        if whole.ex.succeeded() && streamed.ex.succeeded() && parsed(whole) != parsed(streamed) {
            failures += 1;
            find(
                Severity::Failure,
                streamed.id,
                format!(
                    "the same greedy request made different calls streamed and whole: {:?} vs {:?}",
                    streamed.ex.tool_calls, whole.ex.tool_calls
                ),
            );
        }
    }
    let verdict = if failures > 0 {
        Verdict::Fail
    } else if judged < sent.len() {
        Verdict::Warn
    } else {
        Verdict::Pass
    };
    let summary = format!(
        "{judged} of {} answers judged, {calls_seen} calls; {failures} failures (no call, an invalid call, or streamed and whole differ)",
        sent.len()
    );
    (result(verdict, summary), findings)
}

#[cfg(test)]
mod tests {
    use super::{invalid, judge};
    use crate::record::fixtures::{ok, record};
    use crate::report::{Kind, Verdict};
    use oai_client::{Exchange, ToolCallSeen};

    fn calling(name: &str, arguments: &str) -> Exchange {
        let mut ex = ok("", "tool_calls", 20);
        ex.tool_calls = vec![ToolCallSeen {
            name: name.into(),
            arguments: arguments.into(),
        }];
        ex
    }

    fn pair(whole: Exchange, streamed: Exchange) -> Vec<crate::record::Record> {
        let mut s = record(1, 0, Kind::ToolCall, streamed, None);
        s.call.stream = true;
        vec![record(0, 0, Kind::ToolCall, whole, None), s]
    }

    const PARIS: &str = r#"{"city": "Paris", "unit": "celsius"}"#;

    #[test]
    fn valid_calls_pass_text_or_invalid_calls_fail_refusal_is_skipped() {
        let (r, _) = judge(&pair(
            calling("get_weather", PARIS),
            calling("get_weather", r#"{"city":"Paris","unit":"celsius"}"#),
        ));
        assert_eq!(r.verdict, Verdict::Pass, "{}", r.summary);
        let (r, f) = judge(&pair(
            ok("It is sunny.", "stop", 4),
            ok("It is sunny.", "stop", 4),
        ));
        assert_eq!(r.verdict, Verdict::Fail);
        assert!(
            f.iter().any(|(_, _, m)| m.contains("made no call")),
            "{f:?}"
        );
        let (r, _) = judge(&pair(calling("rm", "{}"), calling("rm", "{}")));
        assert_eq!(r.verdict, Verdict::Fail);
        let (r, f) = judge(&pair(
            calling("get_weather", PARIS),
            calling("get_time", r#"{"timezone": "CET"}"#),
        ));
        assert_eq!(r.verdict, Verdict::Fail);
        assert!(
            f.iter().any(|(_, _, m)| m.contains("streamed and whole")),
            "{f:?}"
        );
        let refused = || Exchange {
            status: Some(400),
            error_message: Some("tools is not supported".into()),
            ..Default::default()
        };
        assert_eq!(
            judge(&pair(refused(), refused())).0.verdict,
            Verdict::Skipped
        );
        let (r, _) = judge(&pair(
            ok("<tool_call>{", "length", 160),
            ok("<tool_call>{", "length", 160),
        ));
        assert_eq!(r.verdict, Verdict::Warn);
        let prose = "Paris, the City of Light, is known for its mild weather";
        let (r, f) = judge(&pair(ok(prose, "length", 160), ok(prose, "length", 160)));
        assert_eq!(r.verdict, Verdict::Fail);
        assert!(
            f.iter()
                .any(|(_, _, m)| m.contains("without beginning a call")),
            "{f:?}"
        );
    }

    #[test]
    fn the_validator_knows_both_schemas() {
        let call = |n: &str, a: &str| ToolCallSeen {
            name: n.into(),
            arguments: a.into(),
        };
        assert_eq!(invalid(&call("get_weather", PARIS)), None);
        assert_eq!(invalid(&call("get_time", r#"{"timezone": "UTC"}"#)), None);
        for (n, a) in [
            ("get_weather", r#"{"city": "Paris"}"#),
            ("get_weather", r#"{"city": "Paris", "unit": "kelvin"}"#),
            (
                "get_weather",
                r#"{"city": "Paris", "unit": "celsius", "x": 1}"#,
            ),
            ("get_time", "not json"),
            ("get_time", "[1]"),
            ("delete_all", "{}"),
        ] {
            assert!(invalid(&call(n, a)).is_some(), "{n} {a}");
        }
    }
}
