//! FAULT INJECTION ONLY: compiled with the `fault-injection` feature, never in default
//! builds. It puts the incident's bug back (described at the top of README.md) so that tests can prove
//! `kvwarden audit` reports it: an over-length prompt is not rejected but replaced by a
//! placeholder whose sequence claims the full length over pages it never wrote, and the
//! request goes on to a 200. The placeholder itself is made in `admission.rs`, where every
//! `Admitted` is made.

use std::sync::atomic::{AtomicBool, Ordering};

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
