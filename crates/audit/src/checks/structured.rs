//! Check 6, structured-output honesty: a chat request with OpenAI's `response_format`
//! JSON schema, greedy, once whole and once streamed. A server that refuses it (4xx) does
//! not serve structured outputs, which is reported, not failed; one that accepts it must
//! return, both ways, content that parses and validates whenever it says `stop`, and the
//! same content streamed as whole (greedy, so the two are the same request). Accepting the
//! schema and not enforcing it is a failure: the pattern this audit exists to catch.

use oai_client::{Api, Prompt};
use serde_json::{json, Value};

use crate::auditor::{Auditor, Planned};
use crate::record::Record;
use crate::report::{CheckName, CheckResult, Kind, Severity, Verdict};
use crate::text::clip;

/// A schema a model would not follow unprompted: exact keys, an enum, bounded integers, a
/// nested object and a bounded array.
fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "weather": {"enum": ["sunny", "rainy", "snowy"]},
            "where": {
                "type": "object",
                "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"],
                "additionalProperties": false
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}
        },
        "required": ["city", "rating", "weather", "where", "tags"],
        "additionalProperties": false
    })
}

/// Why `text` does not validate against [`schema`], or `None` when it does.
fn invalid(text: &str) -> Option<String> {
    let v: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => return Some(format!("not JSON ({e})")),
    };
    let Some(o) = v.as_object() else {
        return Some("not a JSON object".into());
    };
    let keys = ["city", "rating", "weather", "where", "tags"];
    if let Some(k) = o.keys().find(|k| !keys.contains(&k.as_str())) {
        return Some(format!("a key the schema forbids: {k:?}"));
    }
    if let Some(k) = keys.iter().find(|k| !o.contains_key(**k)) {
        return Some(format!("a required key is missing: {k:?}"));
    }
    let city_ok = o["city"].as_str().is_some_and(|c| c.chars().count() <= 24);
    let rating_ok = o["rating"].as_i64().is_some_and(|r| (1..=5).contains(&r));
    let weather_ok = ["sunny", "rainy", "snowy"].contains(&o["weather"].as_str().unwrap_or(""));
    let where_ok = o["where"].as_object().is_some_and(|w| {
        w.len() == 2
            && w.get("lat").is_some_and(Value::is_number)
            && w.get("lon").is_some_and(Value::is_number)
    });
    let tags_ok = o["tags"].as_array().is_some_and(|t| {
        t.len() <= 3
            && t.iter()
                .all(|s| s.as_str().is_some_and(|s| s.chars().count() <= 12))
    });
    let wrong: Vec<&str> = [
        ("city", city_ok),
        ("rating", rating_ok),
        ("weather", weather_ok),
        ("where", where_ok),
        ("tags", tags_ok),
    ]
    .into_iter()
    .filter(|(_, ok)| !ok)
    .map(|(k, _)| k)
    .collect();
    (!wrong.is_empty()).then(|| format!("wrong values for {}", wrong.join(", ")))
}

impl Auditor {
    pub(crate) async fn structured(&mut self) -> CheckResult {
        let prompt = "Review a city you visited, as JSON: its name, a rating, the weather, \
                      where it is and a few tags.";
        let mut sent = Vec::new();
        for stream in [false, true] {
            let mut call = self.call(Api::Chat, Prompt::Text(prompt.into()), 0);
            call.stream = stream;
            call.max_tokens = call.max_tokens.max(200);
            call.extra.insert(
                "response_format".into(),
                json!({"type": "json_schema",
                       "json_schema": {"name": "review", "strict": true, "schema": schema()}}),
            );
            let r = self
                .send_one(Planned {
                    tenant: 0,
                    kind: Kind::Structured,
                    call,
                    canary: None,
                    replay_of: None,
                })
                .await;
            sent.push(r);
        }
        let (result, findings) = judge(&sent);
        for (severity, request, message) in findings {
            self.find(CheckName::Structured, severity, Some(request), message);
        }
        result
    }
}

/// The verdict on the whole and streamed answers, and its findings (severity, request,
/// message).
fn judge(sent: &[Record]) -> (CheckResult, Vec<(Severity, usize, String)>) {
    let mut findings = Vec::new();
    let mut find = |severity, request, message| findings.push((severity, request, message));
    {
        let result = |verdict, summary: String| CheckResult {
            check: CheckName::Structured,
            title: CheckName::Structured.title(),
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
                        "structured outputs are not served (refused with a 4xx: {})",
                        clip(why, 160)
                    ),
                ),
                Vec::new(),
            );
        }
        let mut failures = 0;
        let mut judged = 0;
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
                Some("stop") => {
                    judged += 1;
                    if let Some(why) = invalid(&r.ex.content) {
                        failures += 1;
                        find(
                            Severity::Failure,
                            r.id,
                            format!(
                                "the schema was accepted but not enforced ({how}): {why}: {}",
                                clip(&r.ex.content, 200)
                            ),
                        );
                    }
                }
                other => find(
                    Severity::Warning,
                    r.id,
                    format!("the {how} answer ended with {other:?}, not stop: it cannot be judged"),
                ),
            }
        }
        if let [whole, streamed] = sent {
            if whole.ex.succeeded()
                && streamed.ex.succeeded()
                && whole.ex.content != streamed.ex.content
            {
                failures += 1;
                find(
                    Severity::Failure,
                    streamed.id,
                    format!(
                        "the same greedy request gave different content streamed and whole: {:?} vs {:?}",
                        clip(&streamed.ex.content, 120),
                        clip(&whole.ex.content, 120)
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
            "{judged} of {} constrained answers ended with stop; {failures} failures (invalid content, or streamed and whole differ)",
            sent.len()
        );
        (result(verdict, summary), findings)
    }
}

#[cfg(test)]
mod tests {
    use super::{invalid, judge};
    use crate::record::fixtures::{ok, record};
    use crate::report::{Kind, Verdict};
    use oai_client::Exchange;

    const GOOD: &str = r#"{"city": "Lyon", "rating": 4, "weather": "sunny", "where": {"lat": 45.7, "lon": 4.8}, "tags": ["food"]}"#;

    fn pair(whole: Exchange, streamed: Exchange) -> Vec<crate::record::Record> {
        let mut s = record(1, 0, Kind::Structured, streamed, None);
        s.call.stream = true;
        vec![record(0, 0, Kind::Structured, whole, None), s]
    }

    #[test]
    fn accepted_and_not_enforced_fails_refused_is_skipped_and_honest_passes() {
        let (r, _) = judge(&pair(ok(GOOD, "stop", 30), ok(GOOD, "stop", 30)));
        assert_eq!(r.verdict, Verdict::Pass, "{}", r.summary);
        let (r, f) = judge(&pair(
            ok("Lyon is lovely.", "stop", 5),
            ok("Lyon is lovely.", "stop", 5),
        ));
        assert_eq!(r.verdict, Verdict::Fail);
        assert!(
            f.iter().any(|(_, _, m)| m.contains("not enforced")),
            "{f:?}"
        );
        let other = GOOD.replace("Lyon", "Nice");
        let (r, f) = judge(&pair(ok(GOOD, "stop", 30), ok(&other, "stop", 30)));
        assert_eq!(r.verdict, Verdict::Fail);
        assert!(
            f.iter().any(|(_, _, m)| m.contains("streamed and whole")),
            "{f:?}"
        );
        let refused = || Exchange {
            status: Some(400),
            error_message: Some("response_format is not supported".into()),
            ..Default::default()
        };
        assert_eq!(
            judge(&pair(refused(), refused())).0.verdict,
            Verdict::Skipped
        );
        let (r, _) = judge(&pair(
            ok("{\"city\"", "length", 200),
            ok("{\"city\"", "length", 200),
        ));
        assert_eq!(r.verdict, Verdict::Warn);
    }

    #[test]
    fn the_validator_knows_the_schema() {
        let good = r#"{"city": "Lyon", "rating": 4, "weather": "sunny", "where": {"lat": 45.7, "lon": 4.8}, "tags": ["food"]}"#;
        assert_eq!(invalid(good), None);
        for bad in [
            "The city is Lyon.",
            "[1]",
            r#"{"city": "Lyon"}"#,
            r#"{"city": "Lyon", "rating": 9, "weather": "sunny", "where": {"lat": 1, "lon": 2}, "tags": []}"#,
            r#"{"city": "Lyon", "rating": 3, "weather": "foggy", "where": {"lat": 1, "lon": 2}, "tags": []}"#,
            r#"{"city": "Lyon", "rating": 3, "weather": "rainy", "where": {"lat": 1}, "tags": []}"#,
            r#"{"city": "Lyon", "rating": 3, "weather": "rainy", "where": {"lat": 1, "lon": 2}, "tags": [], "x": 1}"#,
        ] {
            assert!(invalid(bad).is_some(), "{bad}");
        }
    }
}
