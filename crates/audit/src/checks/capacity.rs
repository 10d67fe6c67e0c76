//! Check 1, capacity honesty: prompts at, just over and far over the advertised context.

use crate::auditor::{Auditor, Planned};
use crate::inspect::stream_rejected;
use crate::prompts;
use crate::report::{CapacityRow, CheckName, CheckResult, Kind, Severity, Verdict};
use crate::text::clip;
use oai_client::{Api, Prompt};

impl Auditor {
    /// Prompts of exactly the limit, one over and 1.5x over (token ids, so lengths are
    /// exact), and 1.5x over as chat text. Expect success, 4xx, 4xx, 4xx.
    pub async fn capacity(&mut self) -> (CheckResult, Vec<CapacityRow>) {
        let l = self.max_context;
        let cases: Vec<(Kind, String, Prompt, Api, u32)> = vec![
            (
                Kind::AtLimit,
                format!("at the limit: {} prompt + 1 completion = {l}", l - 1),
                Prompt::Tokens(prompts::token_ids(&mut self.rng, l - 1)),
                Api::Completions,
                1,
            ),
            (
                Kind::OneOver,
                format!("one over: {l} prompt + 1 completion = {}", l + 1),
                Prompt::Tokens(prompts::token_ids(&mut self.rng, l)),
                Api::Completions,
                1,
            ),
            (
                Kind::FarOver,
                format!("1.5x: {} prompt tokens", l * 3 / 2),
                Prompt::Tokens(prompts::token_ids(&mut self.rng, l * 3 / 2)),
                Api::Completions,
                1,
            ),
            (
                Kind::FarOverChat,
                format!("1.5x as chat text: over {} words", l * 3 / 2),
                Prompt::Text(prompts::filler(&mut self.rng, l * 3 / 2)),
                Api::Chat,
                self.config.max_tokens,
            ),
        ];
        let mut rows = Vec::new();
        for (kind, case, prompt, api, max_tokens) in cases {
            let prompt_tokens = match &prompt {
                Prompt::Tokens(t) => t.len(),
                Prompt::Text(t) => t.split_whitespace().count(),
            };
            let mut call = self.call(api, prompt, 0);
            call.max_tokens = max_tokens;
            let r = self
                .send_one(Planned {
                    tenant: 0,
                    kind,
                    call,
                    canary: None,
                    replay_of: None,
                })
                .await;
            let ok = r.ex.succeeded();
            let expect_ok = kind == Kind::AtLimit;
            let status = r.ex.status;
            let status_s = status.map_or("no answer".to_owned(), |s| format!("HTTP {s}"));
            let (verdict, detail) = if expect_ok {
                if ok {
                    (
                        Verdict::Pass,
                        format!(
                            "{status_s}, finish_reason {:?}",
                            r.ex.finish_reason.as_deref().unwrap_or("-")
                        ),
                    )
                } else {
                    let msg = format!(
                        "a prompt within the advertised context of {l} was refused: {status_s} {}",
                        clip(
                            r.ex.error_message
                                .as_deref()
                                .or(r.ex.transport_error.as_deref())
                                .unwrap_or(""),
                            200
                        )
                    );
                    self.find(
                        CheckName::Capacity,
                        Severity::Failure,
                        Some(r.id),
                        msg.clone(),
                    );
                    (Verdict::Fail, msg)
                }
            } else if r.ex.ok() && !stream_rejected(&r.ex) {
                let msg = format!(
                    "an over-length prompt ({case}) was answered {status_s} with {} bytes of content: {:?}",
                    r.ex.content.len(),
                    clip(&r.ex.content, 120)
                );
                self.find(
                    CheckName::Capacity,
                    Severity::Failure,
                    Some(r.id),
                    msg.clone(),
                );
                (Verdict::Fail, msg)
            } else if status.is_some_and(|s| (400..500).contains(&s)) || stream_rejected(&r.ex) {
                (
                    Verdict::Pass,
                    format!(
                        "{status_s}: {}",
                        clip(r.ex.error_message.as_deref().unwrap_or(""), 160)
                    ),
                )
            } else {
                let msg = format!(
                    "an over-length prompt ({case}) got {status_s} instead of a 4xx: {}",
                    clip(
                        r.ex.error_message
                            .as_deref()
                            .or(r.ex.transport_error.as_deref())
                            .unwrap_or(""),
                        160
                    )
                );
                self.find(
                    CheckName::Capacity,
                    Severity::Failure,
                    Some(r.id),
                    msg.clone(),
                );
                (Verdict::Fail, msg)
            };
            rows.push(CapacityRow {
                case,
                request: r.id,
                prompt_tokens,
                max_tokens,
                expected: if expect_ok { "2xx" } else { "4xx" },
                status,
                verdict,
                detail,
            });
        }
        let failed = rows.iter().filter(|r| r.verdict == Verdict::Fail).count();
        let statuses: Vec<String> = rows
            .iter()
            .map(|r| r.status.map_or("-".to_owned(), |s| s.to_string()))
            .collect();
        let result = CheckResult {
            check: CheckName::Capacity,
            title: CheckName::Capacity.title(),
            verdict: if failed == 0 { Verdict::Pass } else { Verdict::Fail },
            summary: format!(
                "context {l}: at limit / one over / 1.5x / 1.5x chat -> {} (expected 2xx/4xx/4xx/4xx)",
                statuses.join(" / ")
            ),
        };
        (result, rows)
    }
}
