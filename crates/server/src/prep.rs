//! Prompt preparation (chat templates, BPE over up to the body limit) runs off the async
//! workers, on a bounded number of blocking threads, and stops when its client is gone.
//!
//! Without a bound, every concurrent request would take one of tokio's (up to 512) blocking
//! threads, and a few large bodies could keep every core busy for clients that had long
//! hung up. Here a request waits for one of `limit` workers without holding a thread
//! (a client that leaves while waiting just drops its future), the workers go to tenants
//! fairly (the fewest running first), and the work itself checks a [`Cancel`] flag that is
//! raised when the request's future is dropped.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::oneshot;

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

/// At most `limit` prompt preparations at once, shared fairly between tenants: a freed
/// worker goes to the waiting request of the tenant preparing the fewest now (the one served
/// longest ago among equals), and no tenant holds more than `limit - 1` workers (when
/// `limit` ≥ 2), so one tenant's queue of long texts never delays another tenant's prompt.
#[derive(Debug)]
pub struct PromptWorkers {
    state: Arc<Mutex<Queues>>,
    limit: usize,
}

#[derive(Debug, Default)]
struct Queues {
    free: usize,
    /// The most one tenant may run at once: all workers but one (when there are two or
    /// more), so that another tenant's prompt always finds a worker free of the first's.
    per_tenant: usize,
    /// Preparations running, per tenant (only tenants with some).
    running: HashMap<String, usize>,
    /// Waiting requests, per tenant, oldest first: an arrival number and where to send
    /// the grant (a receiver dropped by a client that left refuses it).
    waiting: HashMap<String, VecDeque<(u64, oneshot::Sender<Grant>)>>,
    arrivals: u64,
    /// The grant number each tenant with work here was last served at: among tenants
    /// running as many, the one served longest ago goes first (round robin).
    last_served: HashMap<String, u64>,
    grants: u64,
}

impl Queues {
    /// Hands free workers to waiting requests: the tenant running the fewest first, then
    /// the one served longest ago, then the oldest request.
    fn dispatch(&mut self, state: &Arc<Mutex<Queues>>) {
        while self.free > 0 {
            let next = self
                .waiting
                .iter()
                .filter_map(|(tenant, q)| {
                    let (arrival, _) = q.front()?;
                    let running = self.running.get(tenant).copied().unwrap_or(0);
                    if running >= self.per_tenant {
                        return None;
                    }
                    let served = self.last_served.get(tenant).copied().unwrap_or(0);
                    Some((running, served, *arrival, tenant.clone()))
                })
                .min();
            let Some((_, _, _, tenant)) = next else {
                return;
            };
            let Some(queue) = self.waiting.get_mut(&tenant) else {
                return;
            };
            let Some((_, sender)) = queue.pop_front() else {
                return;
            };
            if queue.is_empty() {
                self.waiting.remove(&tenant);
            }
            self.free -= 1;
            self.grants += 1;
            self.last_served.insert(tenant.clone(), self.grants);
            *self.running.entry(tenant.clone()).or_default() += 1;
            let grant = Grant {
                state: Some(state.clone()),
                tenant,
            };
            // A client that left dropped its receiver: the grant comes back, and its drop
            // frees the worker again (taking this lock, so not here).
            if let Err(refused) = sender.send(grant) {
                refused.forget_into(self);
            }
        }
    }
}

/// One running preparation's worker; dropping it frees the worker for the next tenant.
#[derive(Debug)]
struct Grant {
    /// `None` once the worker was returned by hand (under a lock already held).
    state: Option<Arc<Mutex<Queues>>>,
    tenant: String,
}

impl Grant {
    /// Returns the worker while the lock is already held.
    fn forget_into(mut self, queues: &mut Queues) {
        release(queues, &self.tenant);
        self.state = None;
    }
}

fn release(queues: &mut Queues, tenant: &str) {
    queues.free += 1;
    if let Some(n) = queues.running.get_mut(tenant) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            queues.running.remove(tenant);
            if !queues.waiting.contains_key(tenant) {
                // Nothing of its left here: the maps hold only tenants with work.
                queues.last_served.remove(tenant);
            }
        }
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        let Some(state) = self.state.take() else {
            return;
        };
        // The queues are changed only in whole steps: a poisoned lock holds consistent data.
        let mut queues = state.lock().unwrap_or_else(PoisonError::into_inner);
        release(&mut queues, &self.tenant);
        queues.dispatch(&state);
    }
}

impl PromptWorkers {
    pub fn new(limit: usize) -> Self {
        let limit = limit.max(1);
        Self {
            state: Arc::new(Mutex::new(Queues {
                free: limit,
                per_tenant: (limit - 1).max(1),
                ..Queues::default()
            })),
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
        let queues = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        self.limit - queues.free
    }

    /// Runs `f` for `tenant` on a blocking thread once a worker is granted to it. `f`
    /// should call [`Cancel::check`] between units of work: once this future is dropped
    /// (the client hung up), the check fails and the thread is free for someone else.
    pub async fn run<T: Send + 'static>(
        &self,
        tenant: &str,
        f: impl FnOnce(&Cancel) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let (sender, receiver) = oneshot::channel();
        {
            let mut queues = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            queues.arrivals += 1;
            let arrival = queues.arrivals;
            queues
                .waiting
                .entry(tenant.to_owned())
                .or_default()
                .push_back((arrival, sender));
            queues.dispatch(&self.state);
        }
        // Dropping this future while waiting drops the receiver: the grant, if one comes,
        // is refused and passed on.
        let grant = receiver
            .await
            .map_err(|_| ApiError::Internal("prompt workers closed".into()))?;
        let cancel = Cancel::default();
        let _raise = RaiseOnDrop(cancel.clone());
        tokio::task::spawn_blocking(move || {
            // Held until the work ends, even if the client has gone: the thread is busy.
            let _grant = grant;
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
        for tenant in ["a", "b", "c"] {
            let (workers, started, gate) = (workers.clone(), started.clone(), gate.clone());
            jobs.push(tokio::spawn(async move {
                workers
                    .run(tenant, move |_| {
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
                    .run("t", move |cancel| {
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

    /// One worker, held by a tenant with three more queued: the next grant goes to another
    /// tenant that asked after them, and a waiter that left is passed over.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_freed_worker_goes_to_the_tenant_running_the_fewest() {
        let workers = Arc::new(PromptWorkers::new(1));
        let order = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new(AtomicBool::new(false));
        let job = |tenant: &'static str, gated: bool| {
            let (workers, order, gate) = (workers.clone(), order.clone(), gate.clone());
            tokio::spawn(async move {
                workers
                    .run(tenant, move |_| {
                        order.lock().unwrap().push(tenant);
                        while gated && !gate.load(Ordering::SeqCst) {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        Ok(())
                    })
                    .await
            })
        };
        let first = job("alice", true);
        until("alice's first runs", || order.lock().unwrap().len() == 1).await;
        let queued: Vec<_> = (0..3).map(|_| job("alice", false)).collect();
        let gone = job("carol", false);
        let bob = job("bob", false);
        until("all queued", || {
            let q = workers.state.lock().unwrap();
            q.waiting.values().map(VecDeque::len).sum::<usize>() == 5
        })
        .await;
        gone.abort();
        let _ = gone.await;
        gate.store(true, Ordering::SeqCst);
        first.await.unwrap().unwrap();
        bob.await.unwrap().unwrap();
        for j in queued {
            j.await.unwrap().unwrap();
        }
        let order = order.lock().unwrap().clone();
        assert_eq!(order, ["alice", "bob", "alice", "alice", "alice"]);
        assert_eq!(workers.busy(), 0);
    }

    /// Two workers, one tenant with many texts: it runs one at a time, and another
    /// tenant's prompt starts at once on the other worker.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_tenant_never_holds_every_worker() {
        let workers = Arc::new(PromptWorkers::new(2));
        let gate = Arc::new(AtomicBool::new(false));
        let started = Arc::new(AtomicUsize::new(0));
        let flood: Vec<_> = (0..4)
            .map(|_| {
                let (workers, gate, started) = (workers.clone(), gate.clone(), started.clone());
                tokio::spawn(async move {
                    workers
                        .run("alice", move |_| {
                            started.fetch_add(1, Ordering::SeqCst);
                            while !gate.load(Ordering::SeqCst) {
                                std::thread::sleep(Duration::from_millis(1));
                            }
                            Ok(())
                        })
                        .await
                })
            })
            .collect();
        until("alice's first runs", || started.load(Ordering::SeqCst) == 1).await;
        // Bob's prompt runs to its end while every text of Alice's is held at the gate.
        workers.run("bob", |_| Ok(())).await.unwrap();
        assert_eq!(started.load(Ordering::SeqCst), 1);
        gate.store(true, Ordering::SeqCst);
        for f in flood {
            f.await.unwrap().unwrap();
        }
        assert_eq!(workers.busy(), 0);
    }
}
