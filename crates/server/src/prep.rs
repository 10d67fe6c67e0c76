//! Prompt preparation (chat templates, BPE over up to the body limit) runs off the async
//! workers, on a bounded number of blocking threads, and stops when its client is gone.
//!
//! Without a bound, every concurrent request would take one of tokio's (up to 512) blocking
//! threads, and a few large bodies could keep every core busy for clients that had long
//! hung up. Here a request waits for one of `limit` permits without holding a thread
//! (a client that leaves while waiting just drops its future), and the work itself checks
//! a [`Cancel`] flag that is raised when the request's future is dropped.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::Semaphore;

use crate::error::ApiError;

/// Raised when the request that asked for the work has gone away (its future was dropped).
#[derive(Debug, Clone, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    /// A flag nobody raises, for work that no request waits on (tests, tools).
    pub fn never() -> Self {
        Self::default()
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// `Err` once the client is gone: call it between units of work.
    pub fn check(&self) -> Result<(), ApiError> {
        if self.is_cancelled() {
            Err(ApiError::Abandoned)
        } else {
            Ok(())
        }
    }

    /// Raises the flag (done for you when a [`PromptWorkers::run`] future is dropped).
    pub fn raise(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Raises the flag when dropped: the awaiting future is dropped when its client goes.
struct RaiseOnDrop(Cancel);

impl Drop for RaiseOnDrop {
    fn drop(&mut self) {
        self.0.raise();
    }
}

/// At most `limit` prompt preparations at once.
#[derive(Debug)]
pub struct PromptWorkers {
    permits: Arc<Semaphore>,
    limit: usize,
}

impl PromptWorkers {
    pub fn new(limit: usize) -> Self {
        let limit = limit.max(1);
        Self {
            permits: Arc::new(Semaphore::new(limit)),
            limit,
        }
    }

    /// One per core: the work is CPU-bound, more threads would only interleave it.
    pub fn per_core() -> Self {
        Self::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Preparations running now.
    pub fn busy(&self) -> usize {
        self.limit - self.permits.available_permits()
    }

    /// Runs `f` on a blocking thread once a permit is free. `f` should call
    /// [`Cancel::check`] between units of work: once this future is dropped (the client
    /// hung up), the check fails and the thread is free for someone else.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Cancel) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::Internal("prompt workers closed".into()))?;
        let cancel = Cancel::default();
        let _raise = RaiseOnDrop(cancel.clone());
        tokio::task::spawn_blocking(move || {
            // Held until the work ends, even if the client has gone: the thread is busy.
            let _permit = permit;
            cancel.check()?;
            f(&cancel)
        })
        .await
        .map_err(|e| ApiError::Internal(format!("prompt worker failed: {e}")))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::{Duration, Instant};

    /// Waits (liveness only, generously) until `f` holds.
    async fn until(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !f() {
            assert!(Instant::now() < deadline, "never happened: {what}");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_more_than_the_limit_run_at_once() {
        let workers = Arc::new(PromptWorkers::new(2));
        let started = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(AtomicBool::new(false));
        let mut jobs = Vec::new();
        for _ in 0..3 {
            let (workers, started, gate) = (workers.clone(), started.clone(), gate.clone());
            jobs.push(tokio::spawn(async move {
                workers
                    .run(move |_| {
                        started.fetch_add(1, Ordering::SeqCst);
                        while !gate.load(Ordering::SeqCst) {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        Ok(())
                    })
                    .await
            }));
        }
        until("two jobs start", || started.load(Ordering::SeqCst) == 2).await;
        assert_eq!(workers.busy(), 2);
        // Both permits are held by blocked jobs: the third cannot have started.
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
        assert_eq!(started.load(Ordering::SeqCst), 2);
        gate.store(true, Ordering::SeqCst);
        for job in jobs {
            job.await.unwrap().unwrap();
        }
        assert_eq!(started.load(Ordering::SeqCst), 3);
        assert_eq!(workers.busy(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn work_stops_when_its_client_is_gone() {
        let workers = Arc::new(PromptWorkers::new(1));
        let started = Arc::new(AtomicBool::new(false));
        let stopped = Arc::new(AtomicBool::new(false));
        let job = {
            let (workers, started, stopped) = (workers.clone(), started.clone(), stopped.clone());
            tokio::spawn(async move {
                workers
                    .run(move |cancel| {
                        started.store(true, Ordering::SeqCst);
                        // "Long" work, in units, checking between them; it would take
                        // minutes if nobody stopped it.
                        for _ in 0..600_000 {
                            if let Err(e) = cancel.check() {
                                stopped.store(true, Ordering::SeqCst);
                                return Err(e);
                            }
                            std::thread::sleep(Duration::from_micros(200));
                        }
                        Ok(())
                    })
                    .await
            })
        };
        until("the work starts", || started.load(Ordering::SeqCst)).await;
        // The client hangs up: its request future is dropped.
        job.abort();
        until("the work notices", || stopped.load(Ordering::SeqCst)).await;
        until("the permit is back", || workers.busy() == 0).await;
    }
}
