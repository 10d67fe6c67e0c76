//! FAULT INJECTION BUILD ONLY (`--features fault-injection`, never in default builds): the
//! switch that puts the incident's bug back into `serve`, so that tests can prove
//! `kvwarden audit` catches it. See `engine::fault`.

pub const WARNING: &str = "\
kvwarden: ******************************************************************\n\
kvwarden: WARNING: FAULT-INJECTION BUILD. It can re-enact the incident's KV leak\n\
kvwarden: (--inject-fault incident). For testing `kvwarden audit` only; never serve\n\
kvwarden: real traffic with it.\n\
kvwarden: ******************************************************************";

/// Applies `--inject-fault` to the serve arguments before the engine starts.
pub fn apply(args: &mut crate::serve_args::ServeArgs) {
    if args.inject_fault.as_deref() == Some("incident") {
        eprintln!(
            "kvwarden: FAULT INJECTED: over-length prompts become placeholders that decode \
             over unwritten pages; KV scrubbing is off"
        );
        engine::fault::inject_incident();
        // Stale pages must keep their old contents for the leak to be observable.
        args.kv_scrub = crate::serve_args::ScrubArg::None;
    }
}
