use handoff_model::Config;
use stateright::{Checker, Model};
use std::time::{Duration, Instant};

fn main() {
    let which = std::env::args().nth(1).unwrap_or_default();
    let lossy = std::env::args()
        .nth(2)
        .map(|s| s == "lossy")
        .unwrap_or(true);
    let mut cfg = match which.as_str() {
        "contention" => Config::contention(),
        _ => Config::over_length(),
    };
    cfg.max_losses = if lossy { 1 } else { 0 };
    let t = Instant::now();
    let c = cfg
        .into_model()
        .checker()
        .threads(1)
        .timeout(Duration::from_secs(60))
        .spawn_bfs()
        .join();
    println!(
        "{which} lossy={lossy}: unique {} total {} depth {} in {:?} done={}",
        c.unique_state_count(),
        c.state_count(),
        c.max_depth(),
        t.elapsed(),
        c.is_done()
    );
    for p in c.model().properties() {
        println!(
            "  {:?} {} -> {}",
            p.expectation,
            p.name,
            c.discovery(p.name).is_some()
        );
    }
}
