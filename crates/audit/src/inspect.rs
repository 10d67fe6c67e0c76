//! What the ledger looks for in every answer as it arrives: dishonest statuses and bodies
//! (the status check's rules) and other requests' canaries (the canaries check's scan).

use std::collections::HashSet;

use crate::canary::{Canary, Normalized};
use crate::record::Record;
use crate::report::{Leak, Severity};
use crate::text::{clip, excerpt};
use oai_client::{Exchange, Prompt};

/// A 2xx stream that carried only an error event: an honest refusal, in stream form.
pub(crate) fn stream_rejected(ex: &Exchange) -> bool {
    ex.stream
        .as_ref()
        .is_some_and(|s| s.error_events == 1 && !s.done)
        && ex.content.is_empty()
}

/// Counts toward the live "wrong statuses" figure.
pub(crate) fn wrong_status(r: &Record, max_context: usize) -> bool {
    status_problems(r, max_context)
        .iter()
        .any(|(s, _)| *s == Severity::Failure)
        || (r.kind.over_length() && r.ex.ok() && !stream_rejected(&r.ex))
}

/// What is dishonest about one response's status and body.
pub(crate) fn status_problems(r: &Record, max_context: usize) -> Vec<(Severity, String)> {
    let ex = &r.ex;
    let mut out = Vec::new();
    if let Some(e) = &ex.transport_error {
        if !ex.cancelled {
            out.push((
                Severity::Failure,
                format!("the connection failed: {}", clip(e, 200)),
            ));
        }
        return out;
    }
    let Some(status) = ex.status else {
        return out;
    };
    if !(200..300).contains(&status) {
        if !ex.error_body_ok {
            out.push((
                Severity::Failure,
                format!(
                    "HTTP {status} without an error body (got {:?})",
                    clip(&ex.raw, 120)
                ),
            ));
        }
        return out;
    }
    if r.kind.over_length() && !stream_rejected(ex) {
        out.push((
            Severity::Failure,
            format!(
                "HTTP {status} for an over-length prompt (advertised context {max_context}) with content {:?}",
                clip(&ex.content, 120)
            ),
        ));
    }
    if let Some(st) = &ex.stream {
        if st.error_events > 1 {
            out.push((
                Severity::Failure,
                format!("{} error events in one stream", st.error_events),
            ));
        }
        if st.events_after_end > 0 {
            out.push((
                Severity::Failure,
                format!(
                    "{} stream events after [DONE] or an error event",
                    st.events_after_end
                ),
            ));
        }
        if st.malformed > 0 {
            out.push((
                Severity::Failure,
                format!("{} stream events that are not JSON", st.malformed),
            ));
        }
        if !ex.cancelled && !st.done && st.error_events == 0 {
            out.push((
                Severity::Failure,
                "the stream ended with neither [DONE] nor an error event: a truncated answer that looks complete".into(),
            ));
        }
        if st.error_events > 0 {
            // An error event ends the request: its partial text is not an answer, and the
            // error said so. Nothing more to check.
            return out;
        }
    } else if ex.error_message.is_some() {
        out.push((
            Severity::Failure,
            format!(
                "HTTP {status} with an error body: {}",
                clip(ex.error_message.as_deref().unwrap_or(""), 160)
            ),
        ));
        return out;
    }
    if ex.cancelled {
        return out;
    }
    let finish = ex.finish_reason.as_deref();
    match finish {
        None => out.push((
            Severity::Failure,
            format!("HTTP {status} without a finish_reason"),
        )),
        Some("stop") | Some("length") => {}
        // OpenAI's reason for an answer that calls tools, when the answer made calls.
        Some("tool_calls") if !ex.tool_calls.is_empty() => {}
        Some(other) => out.push((
            Severity::Warning,
            format!("unusual finish_reason {other:?}"),
        )),
    }
    let Some(usage) = ex.usage else {
        out.push((Severity::Warning, "no usage reported".into()));
        return out;
    };
    let max = u64::from(r.call.max_tokens);
    if let Some(n) = usage.completion_tokens {
        if n > max {
            out.push((
                Severity::Failure,
                format!("{n} completion tokens for max_tokens {max}"),
            ));
        }
        if finish == Some("length") && n != max {
            out.push((
                Severity::Failure,
                format!(
                    "finish_reason \"length\" after {n} completion tokens, but max_tokens is {max}"
                ),
            ));
        }
        if n == 0 && !ex.content.is_empty() {
            out.push((
                Severity::Failure,
                format!(
                    "0 completion tokens reported for {} bytes of text",
                    ex.content.len()
                ),
            ));
        }
        if let Some(tokens) = &ex.logprob_tokens {
            if tokens.len() as u64 != n {
                out.push((
                    Severity::Failure,
                    format!(
                        "{} logprob tokens but {n} completion tokens reported",
                        tokens.len()
                    ),
                ));
            } else if !tokens.iter().any(|t| t.contains('\u{fffd}'))
                && tokens.concat() != ex.content
            {
                out.push((
                    Severity::Warning,
                    format!(
                        "the logprob tokens spell {:?} but the text is {:?}",
                        clip(&tokens.concat(), 80),
                        clip(&ex.content, 80)
                    ),
                ));
            }
        }
    } else {
        out.push((Severity::Warning, "usage without completion_tokens".into()));
    }
    if let (Prompt::Tokens(ids), Some(p)) = (&r.call.prompt, usage.prompt_tokens) {
        if p != ids.len() as u64 {
            out.push((
                Severity::Warning,
                format!("sent {} prompt tokens, usage says {p}", ids.len()),
            ));
        }
    }
    out
}

/// Every other request's canaries found in what `r` received.
pub(crate) fn scan(
    r: &Record,
    canaries: &[(usize, Canary)],
    records: &[Record],
    tenants: &[String],
) -> Vec<Leak> {
    let lp =
        r.ex.logprob_tokens
            .as_ref()
            .map(|t| t.concat())
            .unwrap_or_default();
    let places: [(&'static str, &str); 4] = [
        ("content", &r.ex.content),
        ("logprobs", &lp),
        ("error message", r.ex.error_message.as_deref().unwrap_or("")),
        ("raw response bytes", &r.ex.raw),
    ];
    let normalized: Vec<(&'static str, &str, Normalized)> = places
        .iter()
        .filter(|(_, t)| !t.is_empty())
        .map(|(n, t)| (*n, *t, Normalized::new(t)))
        .collect();
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let owner = r.owner();
    for (id, canary) in canaries {
        if *id == owner || seen.contains(id) {
            continue;
        }
        for (place, text, norm) in &normalized {
            if let Some(part) = canary.found_in(norm) {
                seen.insert(*id);
                let canary_tenant = records.iter().find(|x| x.id == *id).map(|x| x.tenant);
                let name = |t: Option<usize>| {
                    t.and_then(|t| tenants.get(t))
                        .cloned()
                        .unwrap_or_else(|| "not yet answered".into())
                };
                out.push(Leak {
                    canary_of: *id,
                    canary_tenant: name(canary_tenant),
                    canary: part.to_owned(),
                    found_in: r.id,
                    found_tenant: name(Some(r.tenant)),
                    cross_tenant: canary_tenant != Some(r.tenant),
                    location: place,
                    status: r.ex.status,
                    excerpt: excerpt(text, part),
                });
                break;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canary::CanaryMint;
    use crate::record::fixtures::{ok, record};
    use crate::report::Kind;
    use oai_client::{Rng, StreamSeen};

    #[test]
    fn a_canary_in_another_requests_answer_is_a_leak() {
        let mut mint = CanaryMint::new(Rng::new(1));
        let (ca, cb) = (mint.mint(), mint.mint());
        let tenants = vec!["a".to_owned(), "b".to_owned()];
        let a = record(
            1,
            0,
            Kind::RepeatCompletion,
            ok(&ca.text(), "length", 4),
            Some(ca.clone()),
        );
        let leaked = format!("sure: {} {}", ca.word, ca.digits);
        let b = record(
            2,
            1,
            Kind::OverLength,
            ok(&leaked, "length", 4),
            Some(cb.clone()),
        );
        let canaries = vec![(1, ca.clone()), (2, cb)];
        let records = vec![a.clone(), b.clone()];
        // A's own canary in A's answer is not a leak.
        assert!(scan(&a, &canaries, &records, &tenants).is_empty());
        let leaks = scan(&b, &canaries, &records, &tenants);
        assert_eq!(leaks.len(), 1);
        let l = &leaks[0];
        assert_eq!((l.canary_of, l.found_in, l.cross_tenant), (1, 2, true));
        assert_eq!(l.location, "content");
        assert!(l.excerpt.contains(&ca.digits), "{}", l.excerpt);
        // A replay is the same request: its own canary is not a leak.
        let mut replay = record(3, 0, Kind::Replay, ok(&ca.text(), "length", 4), Some(ca));
        replay.replay_of = Some(1);
        assert!(scan(&replay, &canaries, &records, &tenants).is_empty());
    }

    #[test]
    fn dishonest_statuses_are_named() {
        let good = record(
            1,
            0,
            Kind::RepeatCompletion,
            ok("a b c d", "length", 4),
            None,
        );
        assert!(status_problems(&good, 100).is_empty());
        let short = record(1, 0, Kind::RepeatCompletion, ok("a b", "length", 2), None);
        assert!(status_problems(&short, 100)[0].1.contains("length"));
        let over = record(1, 0, Kind::OneOver, ok("text", "length", 4), None);
        assert!(wrong_status(&over, 100));
        assert!(status_problems(&over, 100)[0].1.contains("over-length"));
        let bare = Exchange {
            status: Some(500),
            raw: "oops".into(),
            ..Default::default()
        };
        assert_eq!(
            status_problems(&record(1, 0, Kind::Document, bare, None), 100)[0].0,
            Severity::Failure
        );
        let truncated = Exchange {
            stream: Some(StreamSeen {
                data_events: 3,
                ..Default::default()
            }),
            ..ok("abc", "length", 4)
        };
        let p = status_problems(&record(1, 0, Kind::Document, truncated, None), 100);
        assert!(
            p.iter()
                .any(|(s, m)| *s == Severity::Failure && m.contains("neither")),
            "{p:?}"
        );
        let refused_in_stream = Exchange {
            status: Some(200),
            error_message: Some("too long".into()),
            stream: Some(StreamSeen {
                data_events: 1,
                error_events: 1,
                ..Default::default()
            }),
            ..Default::default()
        };
        let r = record(1, 0, Kind::OverLength, refused_in_stream, None);
        assert!(status_problems(&r, 100).is_empty() && !wrong_status(&r, 100));
    }
}
