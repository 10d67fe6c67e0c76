//! The audit's results: one structure, written as a summary table, JSON and HTML.

use serde::Serialize;

use crate::canary::Canary;
use oai_client::{Api, UsageSeen};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Pass,
    Warn,
    Fail,
    Skipped,
}

impl Verdict {
    pub fn label(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Warn => "WARN",
            Verdict::Fail => "FAIL",
            Verdict::Skipped => "SKIP",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Failure,
    Warning,
}

/// The eight checks, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum CheckName {
    Capacity,
    Canaries,
    Differential,
    Status,
    SideChannel,
    Structured,
    StreamEquality,
    ToolCalls,
}

impl CheckName {
    pub const ALL: [CheckName; 8] = [
        CheckName::Capacity,
        CheckName::Canaries,
        CheckName::Differential,
        CheckName::Status,
        CheckName::SideChannel,
        CheckName::Structured,
        CheckName::StreamEquality,
        CheckName::ToolCalls,
    ];

    pub fn title(self) -> &'static str {
        match self {
            CheckName::Capacity => "capacity honesty",
            CheckName::Canaries => "cross-tenant canaries",
            CheckName::Differential => "differential content",
            CheckName::Status => "status honesty",
            CheckName::SideChannel => "prefix-cache side channel",
            CheckName::Structured => "structured-output honesty",
            CheckName::StreamEquality => "stream = whole",
            CheckName::ToolCalls => "tool-call validity",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct CheckResult {
    pub check: CheckName,
    pub title: &'static str,
    pub verdict: Verdict,
    pub summary: String,
}

/// One thing wrong (or worth knowing), tied to a request where there is one.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    pub check: CheckName,
    pub severity: Severity,
    pub message: String,
    pub request: Option<usize>,
}

/// Why a request was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Calibration,
    AtLimit,
    OneOver,
    FarOver,
    FarOverChat,
    PressureFill,
    OverLength,
    RepeatChat,
    RepeatCompletion,
    Document,
    DocumentChat,
    NearLimit,
    Cancelled,
    Replay,
    SideChannel,
    Structured,
    StreamPair,
    ToolCall,
}

impl Kind {
    pub fn label(self) -> &'static str {
        match self {
            Kind::Calibration => "calibration",
            Kind::AtLimit => "at limit",
            Kind::OneOver => "one over",
            Kind::FarOver => "1.5x over",
            Kind::FarOverChat => "1.5x over (chat)",
            Kind::PressureFill => "pool fill",
            Kind::OverLength => "over-length",
            Kind::RepeatChat => "repeat (chat)",
            Kind::RepeatCompletion => "repeat",
            Kind::Document => "document",
            Kind::DocumentChat => "document (chat)",
            Kind::NearLimit => "near limit",
            Kind::Cancelled => "cancelled stream",
            Kind::Replay => "solo replay",
            Kind::Structured => "structured output",
            Kind::StreamPair => "stream = whole pair",
            Kind::ToolCall => "tool call",
            Kind::SideChannel => "side channel",
        }
    }

    /// Requests that must be refused.
    pub fn over_length(self) -> bool {
        matches!(
            self,
            Kind::OneOver | Kind::FarOver | Kind::FarOverChat | Kind::OverLength
        )
    }
}

/// One request as the report shows it.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRow {
    pub id: usize,
    pub tenant: String,
    pub kind: Kind,
    pub api: Api,
    pub stream: bool,
    pub prompt: String,
    pub max_tokens: u32,
    pub status: Option<u16>,
    pub finish_reason: Option<String>,
    pub usage: Option<UsageSeen>,
    pub ttft_ms: Option<f64>,
    pub total_ms: f64,
    pub bytes: usize,
    /// The answer's text (clipped), for people reading the report.
    pub content: String,
    pub canary: Option<Canary>,
    pub replay_of: Option<usize>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CapacityRow {
    pub case: String,
    pub request: usize,
    pub prompt_tokens: usize,
    pub max_tokens: u32,
    pub expected: &'static str,
    pub status: Option<u16>,
    pub verdict: Verdict,
    pub detail: String,
}

/// A canary of one request found in the bytes another request received.
#[derive(Debug, Clone, Serialize)]
pub struct Leak {
    pub canary_of: usize,
    pub canary_tenant: String,
    pub canary: String,
    pub found_in: usize,
    pub found_tenant: String,
    pub cross_tenant: bool,
    /// content, stream, logprobs, error or raw.
    pub location: &'static str,
    pub status: Option<u16>,
    pub excerpt: String,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Differential {
    pub compared: usize,
    pub identical: usize,
    pub batch_invariance_claimed: bool,
    pub differing: Vec<(usize, usize)>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SideChannelTrial {
    pub prefix_tokens: usize,
    pub a_cold_ms: f64,
    pub a_repeat_ms: f64,
    pub b_same_prefix_ms: f64,
    pub b_fresh_ms: f64,
    pub a_repeat_cached: Option<u64>,
    pub b_same_prefix_cached: Option<u64>,
    pub b_fresh_cached: Option<u64>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct SideChannel {
    pub tenants: (String, String),
    pub real_tenants: bool,
    pub trials: Vec<SideChannelTrial>,
    /// The server reported cached prompt tokens on B's request for A's prefix.
    pub reported_cross_hit: bool,
    /// Timings alone suggest B's request hit A's cached prefix.
    pub timing_cross_hit: bool,
    pub own_cache_visible: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub endpoint: String,
    pub model: String,
    pub max_context: usize,
    pub context_source: String,
    /// What `/health` said (a kvwarden fault-injection build says so there).
    pub health: serde_json::Value,
    pub tenants: Vec<String>,
    pub real_tenants: bool,
    pub seed: u64,
    pub duration_s: f64,
    pub checks: Vec<CheckResult>,
    pub findings: Vec<Finding>,
    pub capacity: Vec<CapacityRow>,
    pub leaks: Vec<Leak>,
    pub differential: Differential,
    pub side_channel: Option<SideChannel>,
    pub requests: Vec<RequestRow>,
    pub passed: bool,
}

impl Report {
    pub fn failures(&self) -> usize {
        self.findings
            .iter()
            .filter(|f| f.severity == Severity::Failure)
            .count()
    }

    /// The summary table printed at the end of a run.
    pub fn summary_text(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "kvwarden audit of {} (model {}, context {} from {}, {} tenants{})",
            self.endpoint,
            self.model,
            self.max_context,
            self.context_source,
            self.tenants.len(),
            if self.real_tenants {
                ", one per API key"
            } else {
                ", synthetic identities"
            }
        );
        if self.health.get("fault_injection").and_then(|v| v.as_bool()) == Some(true) {
            let _ = writeln!(
                out,
                "the server says it is a FAULT-INJECTION build: {}",
                self.health
            );
        }
        let w = self
            .checks
            .iter()
            .map(|c| c.title.len())
            .max()
            .unwrap_or(10);
        let _ = writeln!(out, "\n  {:<w$}  result  details", "check");
        let _ = writeln!(out, "  {:-<w$}  ------  -------", "");
        for c in &self.checks {
            let _ = writeln!(
                out,
                "  {:<w$}  {:<6}  {}",
                c.title,
                c.verdict.label(),
                c.summary
            );
        }
        let _ = writeln!(
            out,
            "\n  {} requests in {:.1} s; {} leaks; {} failures; {} warnings",
            self.requests.len(),
            self.duration_s,
            self.leaks.len(),
            self.failures(),
            self.findings.len() - self.failures()
        );
        if !self.findings.is_empty() {
            let _ = writeln!(out, "\nfindings:");
            for f in &self.findings {
                let sev = match f.severity {
                    Severity::Failure => "FAIL",
                    Severity::Warning => "warn",
                };
                let req = f
                    .request
                    .map(|r| format!(" [request #{r}]"))
                    .unwrap_or_default();
                let _ = writeln!(out, "  {sev} {}{req}: {}", f.check.title(), f.message);
            }
        }
        for l in &self.leaks {
            let _ = writeln!(
                out,
                "\nLEAK: request #{} ({}) received the canary {:?} of request #{} ({}) in its {}:\n  {}",
                l.found_in,
                l.found_tenant,
                l.canary,
                l.canary_of,
                l.canary_tenant,
                l.location,
                l.excerpt
            );
        }
        let _ = writeln!(
            out,
            "\nverdict: {}",
            if self.passed { "PASS" } else { "FAIL" }
        );
        out
    }
}
