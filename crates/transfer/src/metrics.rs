//! Counters of the internal API: handoffs, bytes moved, their duration, and every failure
//! by reason.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use histogram::Histogram;

/// Every failure label, so that each series exists (at 0) before its first failure.
pub const FAILURE_REASONS: [&str; 11] = [
    "checksum",
    "coverage",
    "manifest",
    "timeout",
    "peer_gone",
    "auth",
    "capacity",
    "isolation",
    "model",
    "shutdown",
    "protocol",
];

const DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

#[derive(Debug)]
pub struct TransferMetrics {
    /// Handoffs verified (decode) or pushed and accepted (prefill).
    pub transfers: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
    pub duration: Histogram,
    failures: [AtomicU64; FAILURE_REASONS.len()],
    /// Requests that reached this node's admission, per RPC, and how many it refused.
    pub admitted: AtomicU64,
    pub rejected: AtomicU64,
    /// Decode role: requests this node was asked to decode (reached its admission).
    pub decode_requests: AtomicU64,
}

impl Default for TransferMetrics {
    fn default() -> Self {
        Self {
            transfers: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
            bytes_received: AtomicU64::new(0),
            duration: Histogram::new(DURATION_BUCKETS),
            failures: Default::default(),
            admitted: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            decode_requests: AtomicU64::new(0),
        }
    }
}

impl TransferMetrics {
    /// Counts a failure; a label outside [`FAILURE_REASONS`] counts as `protocol`.
    pub fn failure(&self, reason: &str) {
        let i = FAILURE_REASONS
            .iter()
            .position(|r| *r == reason)
            .unwrap_or(FAILURE_REASONS.len() - 1);
        self.failures[i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn failures(&self, reason: &str) -> u64 {
        FAILURE_REASONS
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| self.failures[i].load(Ordering::Relaxed))
    }

    pub fn transferred(&self, sent: bool, bytes: usize, took: Duration) {
        let counter = if sent {
            &self.bytes_sent
        } else {
            &self.bytes_received
        };
        counter.fetch_add(bytes as u64, Ordering::Relaxed);
        self.transfers.fetch_add(1, Ordering::Relaxed);
        self.duration.observe(took);
    }

    pub fn render(&self, out: &mut String) {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# HELP kvwarden_transfers_total KV handoffs completed and verified.\n# TYPE kvwarden_transfers_total counter\nkvwarden_transfers_total {}",
            get(&self.transfers)
        );
        let _ = writeln!(
            out,
            "# HELP kvwarden_transfer_bytes_total KV payload bytes moved between nodes.\n# TYPE kvwarden_transfer_bytes_total counter\nkvwarden_transfer_bytes_total{{direction=\"sent\"}} {}\nkvwarden_transfer_bytes_total{{direction=\"received\"}} {}",
            get(&self.bytes_sent),
            get(&self.bytes_received)
        );
        self.duration.render(
            out,
            "kvwarden_transfer_duration_seconds",
            "Time from the first to the last byte of a KV handoff.",
        );
        let _ = writeln!(
            out,
            "# HELP kvwarden_transfer_failures_total Handoffs and internal calls that failed, by reason.\n# TYPE kvwarden_transfer_failures_total counter"
        );
        for (reason, count) in FAILURE_REASONS.iter().zip(&self.failures) {
            let _ = writeln!(
                out,
                "kvwarden_transfer_failures_total{{reason=\"{reason}\"}} {}",
                get(count)
            );
        }
        let _ = writeln!(
            out,
            "# HELP kvwarden_node_admissions_total Requests that reached this node's admission, by verdict.\n# TYPE kvwarden_node_admissions_total counter\nkvwarden_node_admissions_total{{verdict=\"admitted\"}} {}\nkvwarden_node_admissions_total{{verdict=\"rejected\"}} {}",
            get(&self.admitted),
            get(&self.rejected)
        );
        let _ = writeln!(
            out,
            "# HELP kvwarden_node_decode_requests_total Requests this node was asked to decode.\n# TYPE kvwarden_node_decode_requests_total counter\nkvwarden_node_decode_requests_total {}",
            get(&self.decode_requests)
        );
    }
}
