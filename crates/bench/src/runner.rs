//! Sends the requests: a fixed number in flight (closed loop), or started at Poisson
//! arrival times (open loop, optionally capped in flight), and times everything.

use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use oai_client::{Call, Client, Exchange};
use tokio::sync::Semaphore;

/// When requests start.
#[derive(Debug, Clone)]
pub enum Schedule {
    /// Each of `concurrency` clients sends its next request when its last one ends.
    Closed { concurrency: usize },
    /// Request `i` starts at `arrivals[i]` from the start, if fewer than `max_in_flight`
    /// are in flight then (otherwise as soon as one ends).
    Open {
        arrivals: Vec<Duration>,
        max_in_flight: Option<usize>,
    },
}

/// Every exchange, in request order, and the wall time from the first send to the last end.
pub struct Run {
    pub exchanges: Vec<Exchange>,
    pub wall: Duration,
}

pub async fn run(client: &Client, calls: Vec<Call>, schedule: &Schedule, progress: bool) -> Run {
    let bar = Bar::new(calls.len(), progress);
    let permits = match schedule {
        Schedule::Closed { concurrency } => *concurrency,
        Schedule::Open { max_in_flight, .. } => max_in_flight.unwrap_or(Semaphore::MAX_PERMITS),
    };
    let permits = Arc::new(Semaphore::new(permits.clamp(1, Semaphore::MAX_PERMITS)));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(calls.len());
    for (i, call) in calls.into_iter().enumerate() {
        if let Schedule::Open { arrivals, .. } = schedule {
            if let Some(at) = arrivals.get(i) {
                tokio::time::sleep_until((start + *at).into()).await;
            }
        }
        // The semaphore is never closed, so acquiring fails only if it were; a request
        // then simply runs without a permit rather than being lost.
        let permit = permits.clone().acquire_owned().await.ok();
        let client = client.clone();
        let bar = bar.clone();
        tasks.push(tokio::spawn(async move {
            let ex = client.call(&call).await;
            drop(permit);
            bar.done(ex.succeeded());
            ex
        }));
    }
    let mut exchanges = Vec::with_capacity(tasks.len());
    for t in tasks {
        exchanges.push(t.await.unwrap_or_else(|e| Exchange {
            transport_error: Some(format!("the request's task ended abnormally: {e}")),
            ..Default::default()
        }));
    }
    let wall = start.elapsed();
    bar.finish();
    Run { exchanges, wall }
}

/// The progress bar on stderr; drawn only when stderr is a terminal.
#[derive(Clone)]
struct Bar {
    bar: ProgressBar,
    counts: Arc<std::sync::Mutex<(usize, usize)>>,
}

impl Bar {
    fn new(len: usize, visible: bool) -> Self {
        use std::io::IsTerminal;
        let target = if visible && std::io::stderr().is_terminal() {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(Some(len as u64), target);
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} requests · {msg}",
        ) {
            bar.set_style(style);
        }
        bar.set_message("ok 0 · failed 0");
        Self {
            bar,
            counts: Arc::default(),
        }
    }

    fn done(&self, ok: bool) {
        let (good, bad) = {
            let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
            if ok {
                c.0 += 1;
            } else {
                c.1 += 1;
            }
            *c
        };
        self.bar.inc(1);
        self.bar.set_message(format!("ok {good} · failed {bad}"));
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
