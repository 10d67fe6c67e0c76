//! Checks one deployment and prints the state count, the time, and a minimal trace of every
//! discovery (counterexamples to `always`/`eventually`, examples of `sometimes`).
//!
//! ```text
//! cargo run -p handoff-model --example explore -- [contention] [losses=N] [crashes=N]
//!     [prefill=honest|faulty|placeholder] [decode=verify|skip|late]
//!     [router=correct|proceed|no-deadline] [threads=N]
//! ```
//!
//! The default deployment is `Config::over_length()`.

use std::time::Instant;

use handoff_model::trace::{describe_path, minimize};
use handoff_model::{Config, DecodeBehaviour, PrefillBehaviour, RouterBehaviour};
use stateright::{Checker, Expectation, Model};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut cfg = if args.iter().any(|a| a == "contention") {
        Config::contention()
    } else {
        Config::over_length()
    };
    let mut threads = 1;
    for arg in &args {
        match arg.split_once('=').unwrap_or((arg, "")) {
            ("contention", _) => {}
            ("losses", n) => cfg.max_losses = n.parse().expect("losses=N"),
            ("crashes", n) => cfg.max_crashes = n.parse().expect("crashes=N"),
            ("threads", n) => threads = n.parse().expect("threads=N"),
            ("prefill", "honest") => cfg.prefill = PrefillBehaviour::Honest,
            ("prefill", "faulty") => cfg.prefill = PrefillBehaviour::Faulty,
            ("prefill", "placeholder") => cfg.prefill = PrefillBehaviour::PlaceholderOnOverLength,
            ("decode", "verify") => cfg.decode = DecodeBehaviour::Verify,
            ("decode", "skip") => cfg.decode = DecodeBehaviour::SkipVerification,
            ("decode", "late") => cfg.decode = DecodeBehaviour::WriteLatePushes,
            ("router", "correct") => cfg.router = RouterBehaviour::Correct,
            ("router", "proceed") => cfg.router = RouterBehaviour::ProceedOnPrefillRejection,
            ("router", "no-deadline") => cfg.router = RouterBehaviour::NoDeadline,
            _ => panic!("unknown argument {arg:?}"),
        }
    }
    println!("{cfg:?}");
    let start = Instant::now();
    let checker = cfg
        .into_model()
        .checker()
        .threads(threads)
        .spawn_bfs()
        .join();
    println!(
        "{} unique states ({} generated), depth {}, {:?}",
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        start.elapsed()
    );
    for property in checker.model().properties() {
        let found = checker.discovery(property.name);
        let verdict = match (&property.expectation, found.is_some()) {
            (Expectation::Sometimes, true) => "example",
            (Expectation::Sometimes, false) => "NO EXAMPLE",
            (_, true) => "COUNTEREXAMPLE",
            (_, false) => "holds",
        };
        println!(
            "{verdict:>14}: {:?} {}",
            property.expectation, property.name
        );
        if let (Some(path), Expectation::Always | Expectation::Eventually) =
            (found, &property.expectation)
        {
            let path = minimize(checker.model(), property.name, &path);
            println!("{}\n", describe_path(&path));
        }
    }
}
