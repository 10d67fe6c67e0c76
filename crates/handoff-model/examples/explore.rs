use handoff_model::{Config, PrefillBehaviour};
use stateright::{Checker, Model};
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut cfg = Config::over_length();
    for a in &args {
        match a.split_once('=') {
            Some(("losses", n)) => cfg.max_losses = n.parse().unwrap(),
            Some(("crashes", n)) => cfg.max_crashes = n.parse().unwrap(),
            Some(("prefill", "honest")) => cfg.prefill = PrefillBehaviour::Honest,
            _ if a == "contention" => cfg = Config::contention(),
            _ => {}
        }
    }
    let t = Instant::now();
    let c = cfg
        .into_model()
        .checker()
        .threads(1)
        .timeout(Duration::from_secs(60))
        .spawn_bfs()
        .join();
    println!(
        "{args:?}: unique {} total {} depth {} in {:?} done={}",
        c.unique_state_count(),
        c.state_count(),
        c.max_depth(),
        t.elapsed(),
        c.is_done()
    );
    for p in c.model().properties() {
        if c.discovery(p.name).is_some() != (p.expectation == stateright::Expectation::Sometimes) {
            println!("  !! {:?} {}", p.expectation, p.name);
        }
    }
}
