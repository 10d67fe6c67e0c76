//! Check 2, cross-tenant canaries: the canary traffic, and the verdict on the leaks the
//! ledger found in it (the scan itself, run on every answer as it arrives, is `inspect::scan`).

use crate::auditor::{Auditor, Planned};
use crate::canary::Canary;
use crate::prompts;
use crate::record::Record;
use crate::report::{CheckName, CheckResult, Kind, Leak, Severity, Verdict};
use oai_client::{Api, Prompt};

impl Auditor {
    /// Measures bytes per token of canary text, so pool-filling prompts land near the limit.
    async fn calibrate(&mut self) {
        let c = self.mint.mint();
        let text = prompts::repeated(&c, 400);
        let bytes = text.len();
        let mut call = self.call(Api::Completions, Prompt::Text(text), 0);
        call.max_tokens = 1;
        let r = self
            .send_one(Planned {
                tenant: 0,
                kind: Kind::Calibration,
                call,
                canary: Some(c),
                replay_of: None,
            })
            .await;
        if let Some(t) = r.ex.usage.and_then(|u| u.prompt_tokens).filter(|&t| t > 0) {
            self.bytes_per_token = (bytes as f64 / t as f64).max(1.0);
        }
        let words = 200;
        let text = prompts::filler(&mut self.rng, words);
        let mut call = self.call(Api::Completions, Prompt::Text(text), 0);
        call.max_tokens = 1;
        let r = self
            .send_one(Planned {
                tenant: 0,
                kind: Kind::Calibration,
                call,
                canary: None,
                replay_of: None,
            })
            .await;
        if let Some(t) = r.ex.usage.and_then(|u| u.prompt_tokens).filter(|&t| t > 0) {
            self.words_per_token = (words as f64 / t as f64).min(1.0);
        }
    }

    /// A document of about `tokens` tokens with the canary at its start, middle and end.
    fn document_tokens(&mut self, c: &Canary, tokens: usize) -> String {
        let words = (tokens as f64 * self.words_per_token * 0.97) as usize;
        prompts::document(&mut self.rng, c, words)
    }

    /// Text of about `tokens` tokens of repeated canary.
    fn repeated_tokens(&self, c: &Canary, tokens: usize) -> String {
        // 3% under the estimate: a different tokenization of the tail must not push a
        // near-limit prompt over.
        prompts::repeated(c, (tokens as f64 * self.bytes_per_token * 0.97) as usize)
    }

    /// Plans and sends the canary traffic; returns the ids of the concurrent mix.
    pub async fn canaries(&mut self) -> Vec<usize> {
        self.calibrate().await;
        let l = self.max_context;
        let mt = self.config.max_tokens as usize;
        let t = self.tenants.len();
        // Pool pressure, sequentially: tenant A fills most of the context with a repeated
        // canary, then tenant B sends an over-length prompt. A server that keeps B alive on
        // a placeholder over A's stale pages (the incident) echoes A's canary to B.
        for i in 0..self.config.pressure_pairs {
            let (a, b) = (i % t, (i + 1) % t);
            let ca = self.mint.mint();
            let fill = self.repeated_tokens(&ca, (l * 9 / 10).saturating_sub(mt));
            let planned_a = Planned {
                tenant: a,
                kind: Kind::PressureFill,
                call: self.call(Api::Completions, Prompt::Text(fill), a),
                canary: Some(ca),
                replay_of: None,
            };
            self.send_all(vec![planned_a], 1).await;
            let cb = self.mint.mint();
            let over = prompts::over_length(&mut self.rng, &cb, l * 3 / 2);
            let mut call = self.over_length_call(Api::Completions, over, b);
            // Each pair asks for a few more tokens: were the over-length request wrongly
            // decoded over stale pages, its length shifts where it lands in A's text.
            call.max_tokens += 5 * i as u32;
            let planned_b = Planned {
                tenant: b,
                kind: Kind::OverLength,
                call,
                canary: Some(cb),
                replay_of: None,
            };
            self.send_all(vec![planned_b], 1).await;
        }
        // The concurrent mix: every kind of request at once, so pages change hands under
        // load, with preemption where the pool is smaller than the sum of the prompts.
        let mut planned = Vec::with_capacity(self.config.requests);
        for i in 0..self.config.requests {
            let tenant = i % t;
            let c = self.mint.mint();
            let (kind, api, prompt, stream, logprobs) = match i % 8 {
                0 => (
                    Kind::RepeatChat,
                    Api::Chat,
                    format!(
                        "Repeat the following code exactly, five times, separated by spaces: {}",
                        c.text()
                    ),
                    true,
                    true,
                ),
                1 => (
                    Kind::RepeatCompletion,
                    Api::Completions,
                    self.repeated_tokens(&c, l * 3 / 10),
                    false,
                    true,
                ),
                2 => (
                    Kind::Document,
                    Api::Completions,
                    self.document_tokens(&c, l * 2 / 5),
                    true,
                    false,
                ),
                3 => (
                    Kind::OverLength,
                    Api::Completions,
                    prompts::over_length(&mut self.rng, &c, l * 3 / 2),
                    false,
                    false,
                ),
                4 => (
                    Kind::Cancelled,
                    Api::Chat,
                    format!(
                        "Write a long story about a ship called {}. Start now.",
                        c.text()
                    ),
                    true,
                    false,
                ),
                5 => (
                    Kind::NearLimit,
                    Api::Completions,
                    self.repeated_tokens(&c, (l * 9 / 10).saturating_sub(mt)),
                    true,
                    false,
                ),
                6 => (
                    Kind::DocumentChat,
                    Api::Chat,
                    self.document_tokens(&c, l / 4),
                    false,
                    true,
                ),
                _ => (
                    Kind::OverLength,
                    Api::Chat,
                    prompts::over_length(&mut self.rng, &c, l * 3 / 2),
                    true,
                    false,
                ),
            };
            let mut call = if kind == Kind::OverLength {
                self.over_length_call(api, prompt, tenant)
            } else {
                self.call(api, Prompt::Text(prompt), tenant)
            };
            call.stream = stream;
            call.logprobs = logprobs;
            if kind == Kind::Cancelled {
                call.max_tokens = call.max_tokens.max(64);
                call.cancel_after = Some(3);
            }
            planned.push(Planned {
                tenant,
                kind,
                call,
                canary: Some(c),
                replay_of: None,
            });
        }
        let concurrency = self.config.concurrency;
        self.send_all(planned, concurrency).await
    }

    pub(crate) fn canary_result(&mut self, leaks: &[Leak], records: &[Record]) -> CheckResult {
        let canaries = records
            .iter()
            .filter(|r| r.canary.is_some() && r.replay_of.is_none())
            .count();
        let scanned: usize = records.iter().map(|r| r.ex.raw_bytes).sum();
        for l in leaks {
            let msg = format!(
                "LEAK: request #{} ({}, HTTP {}) received {:?}, the canary of request #{} ({}){}, in its {}: {}",
                l.found_in,
                l.found_tenant,
                l.status.map_or("-".to_owned(), |s| s.to_string()),
                l.canary,
                l.canary_of,
                l.canary_tenant,
                if l.cross_tenant { ", another tenant" } else { ", same tenant" },
                l.location,
                l.excerpt
            );
            self.find(
                CheckName::Canaries,
                Severity::Failure,
                Some(l.found_in),
                msg,
            );
        }
        let cross = leaks.iter().filter(|l| l.cross_tenant).count();
        CheckResult {
            check: CheckName::Canaries,
            title: CheckName::Canaries.title(),
            verdict: if leaks.is_empty() { Verdict::Pass } else { Verdict::Fail },
            summary: format!(
                "{} canaries in {} requests from {} tenants, {} bytes scanned: {} leaks ({} cross-tenant)",
                canaries,
                records.len(),
                self.tenants.len(),
                scanned,
                leaks.len(),
                cross
            ),
        }
    }
}
