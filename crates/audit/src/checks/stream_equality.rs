//! Check 7, stream = whole: the same greedy request, sent alone, once whole and once
//! streamed, on both endpoints. Streaming is a way of delivering an answer, not another
//! answer: content or finish reason that differ mean one of the two paths changes what the
//! model said (the streamed text reassembled wrongly, a stop string applied differently, a
//! token dropped at a chunk boundary).

use oai_client::{Api, Prompt};

use crate::auditor::{Auditor, Planned};
use crate::record::Record;
use crate::report::{CheckName, CheckResult, Kind, Severity, Verdict};
use crate::text::clip;

const PROMPTS: [&str; 2] = [
    "Write three sentences about a lighthouse keeper and a storm.",
    "List five fruits, one per line, with their colours.",
];

impl Auditor {
    pub(crate) async fn stream_equality(&mut self) -> CheckResult {
        let mut pairs: Vec<(Record, Record)> = Vec::new();
        for api in [Api::Chat, Api::Completions] {
            for prompt in PROMPTS {
                let mut sent = Vec::new();
                for stream in [false, true] {
                    let mut call = self.call(api, Prompt::Text(prompt.into()), 0);
                    call.stream = stream;
                    call.max_tokens = call.max_tokens.max(48);
                    sent.push(
                        self.send_one(Planned {
                            tenant: 0,
                            kind: Kind::StreamPair,
                            call,
                            canary: None,
                            replay_of: None,
                        })
                        .await,
                    );
                }
                let streamed = sent.pop().expect("two were sent");
                let whole = sent.pop().expect("two were sent");
                pairs.push((whole, streamed));
            }
        }
        let (result, findings) = judge(&pairs);
        for (severity, request, message) in findings {
            self.find(CheckName::StreamEquality, severity, Some(request), message);
        }
        result
    }
}

/// The verdict over (whole, streamed) pairs, and its findings.
fn judge(pairs: &[(Record, Record)]) -> (CheckResult, Vec<(Severity, usize, String)>) {
    let mut findings = Vec::new();
    let mut compared = 0;
    let mut differing = 0;
    for (whole, streamed) in pairs {
        if !(whole.ex.succeeded() && streamed.ex.succeeded()) {
            findings.push((
                Severity::Warning,
                streamed.id,
                format!(
                    "a pair could not be compared (HTTP {:?} whole, {:?} streamed)",
                    whole.ex.status, streamed.ex.status
                ),
            ));
            continue;
        }
        compared += 1;
        if whole.ex.content != streamed.ex.content
            || whole.ex.finish_reason != streamed.ex.finish_reason
        {
            differing += 1;
            findings.push((
                Severity::Failure,
                streamed.id,
                format!(
                    "the same greedy request gave another answer streamed (#{}, {:?}: {:?}) than whole (#{}, {:?}: {:?})",
                    streamed.id,
                    streamed.ex.finish_reason.as_deref().unwrap_or("-"),
                    clip(&streamed.ex.content, 100),
                    whole.id,
                    whole.ex.finish_reason.as_deref().unwrap_or("-"),
                    clip(&whole.ex.content, 100),
                ),
            ));
        }
    }
    let verdict = if differing > 0 {
        Verdict::Fail
    } else if compared < pairs.len() {
        Verdict::Warn
    } else {
        Verdict::Pass
    };
    let result = CheckResult {
        check: CheckName::StreamEquality,
        title: CheckName::StreamEquality.title(),
        verdict,
        summary: format!("{compared} greedy pairs compared on both endpoints: {differing} differ"),
    };
    (result, findings)
}

#[cfg(test)]
mod tests {
    use super::judge;
    use crate::record::fixtures::{ok, record};
    use crate::report::{Kind, Verdict};

    #[test]
    fn a_pair_that_differs_fails() {
        let pair = |a: &str, fa: &str, b: &str, fb: &str| {
            (
                record(0, 0, Kind::StreamPair, ok(a, fa, 5), None),
                record(1, 0, Kind::StreamPair, ok(b, fb, 5), None),
            )
        };
        assert_eq!(
            judge(&[pair("x y", "stop", "x y", "stop")]).0.verdict,
            Verdict::Pass
        );
        assert_eq!(
            judge(&[pair("x y", "stop", "x", "stop")]).0.verdict,
            Verdict::Fail
        );
        assert_eq!(
            judge(&[pair("x y", "stop", "x y", "length")]).0.verdict,
            Verdict::Fail
        );
    }
}
