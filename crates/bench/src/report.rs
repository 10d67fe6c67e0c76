//! The benchmark's result: counts, throughput and latency distributions, as a table for
//! people and as JSON for scripts.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use oai_client::Exchange;

use crate::stats::Dist;

/// What was asked for, repeated in the report so a JSON file stands on its own.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Workload {
    /// "tokens" (token-id prompts) or "words" (text prompts).
    pub prompt: String,
    pub prompt_len: usize,
    pub max_tokens: u32,
    pub ignore_eos: bool,
    pub num_requests: usize,
    pub concurrency: Option<usize>,
    pub request_rate: Option<f64>,
    pub seed: u64,
    /// The JSON schema file every answer was constrained to, if any.
    #[serde(default)]
    pub json_schema: Option<String>,
    /// "completions" or "chat".
    #[serde(default = "completions")]
    pub endpoint: String,
    /// The tools file every chat request declared, if any, and its tool choice.
    #[serde(default)]
    pub tools: Option<String>,
    #[serde(default)]
    pub tool_choice: Option<String>,
}

fn completions() -> String {
    "completions".into()
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Report {
    pub base_url: String,
    pub model: String,
    pub workload: Workload,
    pub completed: usize,
    pub failed: usize,
    /// Failed requests by kind ("HTTP 429", "stream error", "transport").
    pub failures: BTreeMap<String, usize>,
    /// The first error message of each kind.
    pub first_errors: BTreeMap<String, String>,
    pub wall_s: f64,
    /// Over completed requests only.
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// Tool calls the completed answers made.
    #[serde(default)]
    pub tool_calls: usize,
    /// How output tokens were counted: "usage" (the server's final usage chunk), "chunks"
    /// (content chunks, when it sent none), or "mixed".
    pub output_counted_by: String,
    pub requests_per_s: f64,
    pub output_tok_s: f64,
    pub total_tok_s: f64,
    /// Time to the first generated text.
    pub ttft_ms: Option<Dist>,
    /// Per request, (end-to-end - TTFT) / (output tokens - 1).
    pub tpot_ms: Option<Dist>,
    /// Gaps between successive content chunks, over all requests.
    pub itl_ms: Option<Dist>,
    pub e2e_ms: Option<Dist>,
}

/// How a failed exchange failed.
fn failure_kind(ex: &Exchange) -> String {
    if ex.transport_error.is_some() {
        "transport".into()
    } else if let Some(s) = ex.status.filter(|s| !(200..300).contains(s)) {
        format!("HTTP {s}")
    } else {
        "stream error".into()
    }
}

fn failure_message(ex: &Exchange) -> String {
    ex.transport_error
        .clone()
        .or_else(|| ex.error_message.clone())
        .unwrap_or_else(|| ex.raw.chars().take(200).collect())
}

impl Report {
    pub fn new(
        base_url: String,
        model: String,
        workload: Workload,
        known_prompt_tokens: Option<u64>,
        exchanges: &[Exchange],
        wall: Duration,
    ) -> Report {
        let mut failures = BTreeMap::new();
        let mut first_errors = BTreeMap::new();
        let (mut ttft, mut tpot, mut itl, mut e2e) = (vec![], vec![], vec![], vec![]);
        let (mut prompt_tokens, mut output_tokens) = (0u64, 0u64);
        let (mut by_usage, mut by_chunks, mut tool_calls) = (0usize, 0usize, 0usize);
        for ex in exchanges {
            if !ex.succeeded() {
                let kind = failure_kind(ex);
                *failures.entry(kind.clone()).or_insert(0) += 1;
                first_errors
                    .entry(kind)
                    .or_insert_with(|| failure_message(ex));
                continue;
            }
            let usage = ex.usage.unwrap_or_default();
            let out = match usage.completion_tokens {
                Some(n) => {
                    by_usage += 1;
                    n
                }
                None => {
                    by_chunks += 1;
                    ex.chunk_times.len() as u64
                }
            };
            output_tokens += out;
            tool_calls += ex.tool_calls.len();
            prompt_tokens += usage.prompt_tokens.or(known_prompt_tokens).unwrap_or(0);
            e2e.push(ex.total);
            if let Some(t) = ex.ttft {
                ttft.push(t);
                if out > 1 {
                    tpot.push(
                        ex.total.saturating_sub(t) / u32::try_from(out - 1).unwrap_or(u32::MAX),
                    );
                }
            }
            itl.extend(ex.chunk_times.windows(2).map(|w| w[1].saturating_sub(w[0])));
        }
        let failed = failures.values().sum();
        let secs = wall.as_secs_f64().max(f64::MIN_POSITIVE);
        let completed = exchanges.len() - failed;
        Report {
            base_url,
            model,
            workload,
            completed,
            failed,
            failures,
            first_errors,
            wall_s: wall.as_secs_f64(),
            prompt_tokens,
            output_tokens,
            tool_calls,
            output_counted_by: match (by_usage, by_chunks) {
                (_, 0) => "usage",
                (0, _) => "chunks",
                _ => "mixed",
            }
            .into(),
            requests_per_s: completed as f64 / secs,
            output_tok_s: output_tokens as f64 / secs,
            total_tok_s: (prompt_tokens + output_tokens) as f64 / secs,
            ttft_ms: Dist::of(&ttft),
            tpot_ms: Dist::of(&tpot),
            itl_ms: Dist::of(&itl),
            e2e_ms: Dist::of(&e2e),
        }
    }

    pub fn table(&self) -> String {
        let w = &self.workload;
        let mut s = String::new();
        let load = match (w.request_rate, w.concurrency) {
            (Some(r), Some(c)) => format!("{r} requests/s (Poisson), at most {c} in flight"),
            (Some(r), None) => format!("{r} requests/s (Poisson)"),
            (None, c) => format!("{} concurrent", c.unwrap_or(1)),
        };
        let _ = writeln!(
            s,
            "kvwarden bench serve: {} ({})",
            self.base_url, self.model
        );
        let _ = writeln!(
            s,
            "workload: {} requests to /v1/{}, {} prompt {} + {} out{}{}, {load}, seed {}",
            w.num_requests,
            if w.endpoint == "chat" {
                "chat/completions"
            } else {
                "completions"
            },
            w.prompt_len,
            w.prompt,
            w.max_tokens,
            if w.ignore_eos { " (ignore_eos)" } else { "" },
            match (&w.tools, &w.tool_choice) {
                (Some(t), Some(c)) => format!(", tools {t} (tool_choice {c})"),
                _ => String::new(),
            },
            w.seed
        );
        let _ = writeln!(s);
        let mut row = |k: &str, v: String| {
            let _ = writeln!(s, "{k:<24}{v}");
        };
        row("requests ok", self.completed.to_string());
        let failed = if self.failures.is_empty() {
            "0".to_owned()
        } else {
            let kinds: Vec<String> = self
                .failures
                .iter()
                .map(|(k, n)| format!("{k}: {n}"))
                .collect();
            format!("{} ({})", self.failed, kinds.join(", "))
        };
        row("requests failed", failed);
        row("wall time (s)", format!("{:.2}", self.wall_s));
        row("prompt tokens", self.prompt_tokens.to_string());
        row(
            "output tokens",
            format!(
                "{} (counted by {})",
                self.output_tokens, self.output_counted_by
            ),
        );
        if w.tools.is_some() {
            row("tool calls", self.tool_calls.to_string());
        }
        row("requests/s", format!("{:.2}", self.requests_per_s));
        row("output tok/s", format!("{:.1}", self.output_tok_s));
        row("total tok/s", format!("{:.1}", self.total_tok_s));
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "{:<24}{:>10}{:>10}{:>10}{:>10}{:>10}",
            "latency (ms)", "mean", "p50", "p90", "p99", "max"
        );
        for (name, d) in [
            ("time to first token", &self.ttft_ms),
            ("time per output token", &self.tpot_ms),
            ("inter-token", &self.itl_ms),
            ("end-to-end", &self.e2e_ms),
        ] {
            match d {
                Some(d) => {
                    let _ = writeln!(
                        s,
                        "{name:<24}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>10.1}",
                        d.mean, d.p50, d.p90, d.p99, d.max
                    );
                }
                None => {
                    let _ = writeln!(s, "{name:<24}{:>10}", "-");
                }
            }
        }
        for (kind, msg) in &self.first_errors {
            let _ = writeln!(s, "first {kind}: {msg}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oai_client::{StreamSeen, UsageSeen};

    fn ok(ms: &[u64], usage: Option<u64>) -> Exchange {
        let t: Vec<Duration> = ms.iter().map(|&m| Duration::from_millis(m)).collect();
        Exchange {
            status: Some(200),
            ttft: t.first().copied(),
            total: t.last().copied().unwrap_or_default() + Duration::from_millis(1),
            chunk_times: t,
            usage: usage.map(|n| UsageSeen {
                completion_tokens: Some(n),
                ..Default::default()
            }),
            stream: Some(StreamSeen {
                done: true,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn workload() -> Workload {
        Workload {
            prompt: "tokens".into(),
            prompt_len: 10,
            max_tokens: 4,
            ignore_eos: true,
            num_requests: 4,
            concurrency: Some(2),
            request_rate: None,
            seed: 0,
            json_schema: None,
            endpoint: completions(),
            tools: None,
            tool_choice: None,
        }
    }

    #[test]
    fn counts_throughput_and_failures() {
        let refused = Exchange {
            status: Some(429),
            error_message: Some("queue full".into()),
            ..Default::default()
        };
        let unreachable = Exchange {
            transport_error: Some("connection refused".into()),
            ..Default::default()
        };
        let exchanges = [
            ok(&[100, 110, 120, 130], Some(4)),
            // No usage chunk: the four content chunks count.
            ok(&[200, 220, 240, 260], None),
            refused,
            unreachable,
        ];
        let r = Report::new(
            "http://x".into(),
            "m".into(),
            workload(),
            Some(10),
            &exchanges,
            Duration::from_secs(2),
        );
        assert_eq!((r.completed, r.failed), (2, 2));
        assert_eq!(r.failures.get("HTTP 429"), Some(&1));
        assert_eq!(r.failures.get("transport"), Some(&1));
        assert_eq!(
            r.first_errors.get("HTTP 429").map(String::as_str),
            Some("queue full")
        );
        assert_eq!((r.output_tokens, r.prompt_tokens), (8, 20));
        assert_eq!(r.output_counted_by, "mixed");
        assert!((r.output_tok_s - 4.0).abs() < 1e-9 && (r.total_tok_s - 14.0).abs() < 1e-9);
        let itl = r.itl_ms.expect("gaps");
        assert_eq!(itl.samples, 6);
        assert!((itl.p50 - 15.0).abs() < 1e-9, "{itl:?}");
        // TPOT: (131 - 100) / 3 and (261 - 200) / 3.
        let tpot = r.tpot_ms.expect("tpot");
        assert!((tpot.mean - (31.0 + 61.0) / 6.0).abs() < 1e-6, "{tpot:?}");
        let table = r.table();
        assert!(
            table.contains("HTTP 429: 1") && table.contains("first transport: connection refused")
        );
        // The JSON round-trips: scripts read what the binary writes.
        let back: Report = serde_json::from_str(&serde_json::to_string(&r).unwrap_or_default())
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back.output_tokens, 8);
    }

    #[test]
    fn a_stream_ending_in_an_error_event_is_a_failure() {
        let mut ex = ok(&[10, 20], Some(2));
        ex.stream = Some(StreamSeen {
            error_events: 1,
            ..Default::default()
        });
        ex.error_message = Some("engine stopped".into());
        let r = Report::new(
            "u".into(),
            "m".into(),
            workload(),
            None,
            &[ex],
            Duration::from_secs(1),
        );
        assert_eq!((r.completed, r.failed), (0, 1));
        assert_eq!(r.failures.get("stream error"), Some(&1));
        assert_eq!(r.ttft_ms, None);
    }
}
