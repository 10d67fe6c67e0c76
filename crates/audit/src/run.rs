//! Runs the enabled checks in order and builds the report.

use std::time::Instant;

use crate::auditor::{lock, Auditor};
use crate::config::Config;
use crate::error::AuditError;
use crate::record::Record;
use crate::report::{CheckName, Differential, Report, RequestRow, Severity, Verdict};
use crate::text::clip;

/// Runs the audit against `config.endpoint`.
pub async fn run(config: Config) -> Result<Report, AuditError> {
    let mut auditor = Auditor::connect(config).await?;
    auditor.run_checks().await
}

impl Auditor {
    /// Runs every enabled check and builds the report.
    pub async fn run_checks(&mut self) -> Result<Report, AuditError> {
        let started = Instant::now();
        let mut results = Vec::new();
        let mut capacity = Vec::new();
        if self.enabled(CheckName::Capacity) {
            let (result, rows) = self.capacity().await;
            capacity = rows;
            results.push(result);
        }
        let mut mix_ids = Vec::new();
        if self.enabled(CheckName::Canaries) {
            mix_ids = self.canaries().await;
        }
        let mut differential = Differential::default();
        if self.enabled(CheckName::Differential) {
            let (result, d) = self.differential(&mix_ids).await;
            differential = d;
            results.push(result);
        }
        let mut side_channel = None;
        if self.enabled(CheckName::SideChannel) {
            let (result, sc) = self.side_channel().await;
            side_channel = Some(sc);
            results.push(result);
        }
        if self.enabled(CheckName::Structured) {
            let result = self.structured().await;
            results.push(result);
        }
        if self.enabled(CheckName::StreamEquality) {
            let result = self.stream_equality().await;
            results.push(result);
        }
        if self.enabled(CheckName::ToolCalls) {
            let result = self.tool_calls().await;
            results.push(result);
        }
        self.progress.finish();
        // Canary and status verdicts come last: they cover every request of the run,
        // replays and side-channel probes included.
        let (leaks, records) = {
            let l = lock(&self.ledger);
            (l.leaks.clone(), l.records.clone())
        };
        if self.enabled(CheckName::Canaries) {
            results.push(self.canary_result(&leaks, &records));
        }
        if self.enabled(CheckName::Status) {
            results.push(self.status(&records));
        }
        results.sort_by_key(|r| CheckName::ALL.iter().position(|c| *c == r.check));
        let mut records = records;
        records.sort_by_key(|r| r.id);
        let requests = records.iter().map(|r| self.row(r)).collect();
        let passed = results.iter().all(|r| r.verdict != Verdict::Fail)
            && !self
                .findings
                .iter()
                .any(|f| f.severity == Severity::Failure);
        Ok(Report {
            endpoint: self.client.base.clone(),
            model: self.client.model.clone(),
            max_context: self.max_context,
            context_source: self.context_source.clone(),
            health: self.health.clone(),
            tenants: self.tenants.iter().map(|t| t.name.clone()).collect(),
            real_tenants: self.real_tenants,
            seed: self.config.seed,
            duration_s: started.elapsed().as_secs_f64(),
            checks: results,
            findings: self.findings.clone(),
            capacity,
            leaks,
            differential,
            side_channel,
            requests,
            passed,
        })
    }

    fn row(&self, r: &Record) -> RequestRow {
        RequestRow {
            id: r.id,
            tenant: self.tenants[r.tenant].name.clone(),
            kind: r.kind,
            api: r.call.api,
            stream: r.call.stream,
            prompt: r.call.prompt.describe(),
            max_tokens: r.call.max_tokens,
            status: r.ex.status,
            finish_reason: r.ex.finish_reason.clone(),
            usage: r.ex.usage,
            ttft_ms: r.ex.ttft.map(|d| d.as_secs_f64() * 1e3),
            total_ms: r.ex.total.as_secs_f64() * 1e3,
            bytes: r.ex.raw_bytes,
            content: clip(&r.ex.content, 400),
            canary: r.canary.clone(),
            replay_of: r.replay_of,
            error: r
                .ex
                .transport_error
                .clone()
                .or_else(|| r.ex.error_message.clone())
                .map(|e| clip(&e, 300)),
        }
    }
}
