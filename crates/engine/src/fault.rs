//! FAULT INJECTION ONLY: compiled with the `fault-injection` feature, never in default
//! builds. It puts the incident's bug back (described at the top of README.md) so that tests can prove
//! `kvwarden audit` reports it: an over-length prompt is not rejected but replaced by a
//! placeholder whose sequence claims the full length over pages it never wrote, and the
//! request goes on to a 200.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::admission::Admitted;
use crate::GenerateRequest;

/// Process-wide, like the bug it re-enacts: one switch the binary sets at start.
static INCIDENT: AtomicBool = AtomicBool::new(false);

/// Turns the incident's bug on for this process.
pub fn inject_incident() {
    INCIDENT.store(true, Ordering::SeqCst);
}

/// Whether the incident's bug is on.
pub fn incident() -> bool {
    INCIDENT.load(Ordering::SeqCst)
}

/// What the incident's prefill did with a rejected prompt: keep the request alive with a
/// placeholder. The placeholder's stream is as long as what fits the context, but only its
/// last position is ever computed: the scheduler declares the rest written
/// (`SequenceKv::fault_claim_unwritten`), so decode reads whatever those pages held.
pub(crate) fn placeholder(request: GenerateRequest, max_context: usize) -> Admitted {
    let max_tokens = request.max_tokens.clamp(1, (max_context / 2).max(1));
    let claimed = max_context.saturating_sub(max_tokens).max(1);
    let token = request.prompt.first().copied().unwrap_or(0);
    Admitted {
        request: GenerateRequest {
            prompt: vec![token; claimed],
            max_tokens,
            ..request
        },
        total_tokens: claimed + max_tokens,
        fault_claim: claimed - 1,
    }
}
