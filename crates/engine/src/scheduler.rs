//! The engine thread: continuous batching with chunked prefill mixed into decode steps.
//!
//! Pages are reserved as a request grows, never read before they are written. Full-pool
//! policy: preempt and recompute. When a running request needs a page and neither the free
//! list nor the prefix cache has one, the most recently started request gives all of its
//! pages back and returns to the head of the queue with what it has generated; later it
//! recomputes that K/V (bit for bit the same: rows do not depend on the batch) and goes on.
//! Nothing ever runs on partial KV. Admission guarantees each request fits the pool alone,
//! and the oldest request is never preempted for a younger one, so every request finishes.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use kv::{
    KvDtype, KvPool, Owner, PoolConfig, PrefixCache, PublicPrefixes, RequestId, ScrubPolicy,
    SequenceKv, Visibility,
};
use model::sampling::{log_softmax, top_logprobs};
use model::{BatchItem, LogitsWanted, Model, ModelError, Sampler};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::admission::{Admission, Admitted};
use crate::{
    EngineError, EngineMetrics, Event, FinishReason, GenerateRequest, SharedMetrics, TokenEvent,
    Usage,
};

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Advertised context; `None` means min(model context, pool capacity).
    pub max_context: Option<usize>,
    pub pool_tokens: usize,
    pub page_tokens: usize,
    pub kv_dtype: KvDtype,
    pub scrub: ScrubPolicy,
    /// Tokens per forward pass (decode rows plus prefill chunks).
    pub max_batch_tokens: usize,
    pub max_running: usize,
    /// Reuse the K/V of earlier prompts within an isolation domain.
    pub prefix_cache: bool,
    /// Token sequences the operator declares public: their pages may be shared across
    /// domains. Everything else is shared only within one domain.
    pub public_prefixes: Vec<Vec<u32>>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_context: None,
            pool_tokens: 16_384,
            page_tokens: 16,
            kv_dtype: KvDtype::F16,
            scrub: ScrubPolicy::Zero,
            max_batch_tokens: 512,
            max_running: 32,
            prefix_cache: true,
            public_prefixes: Vec::new(),
        }
    }
}

/// Reasons a node refuses to start.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("--max-context {context} exceeds the KV pool capacity of {pool} tokens: a request of the advertised length could not be held. Enlarge the pool (--kv-pool-tokens or --kv-pool-mib) to at least {context} tokens or lower --max-context.")]
    ContextExceedsPool { context: usize, pool: usize },
    #[error("--max-context {context} exceeds the model's context length of {model}")]
    ContextExceedsModel { context: usize, model: usize },
    #[error("invalid engine configuration: {0}")]
    Config(String),
}

enum Command {
    Submit {
        id: RequestId,
        admitted: Admitted,
        events: UnboundedSender<Event>,
    },
    Shutdown,
}

/// The client side of one request: its events, in order, ending with `Finished` or
/// `Failed`. Dropping it cancels the request.
pub struct RequestHandle {
    pub id: RequestId,
    pub events: UnboundedReceiver<Event>,
}

/// A cheap, cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    admission: Admission,
    pool: KvPool,
    metrics: SharedMetrics,
    next_id: Arc<std::sync::atomic::AtomicU64>,
}

impl EngineHandle {
    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    pub fn max_context(&self) -> usize {
        self.admission.max_context
    }

    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    pub fn metrics(&self) -> &EngineMetrics {
        &self.metrics
    }

    /// Hands an admitted request to the engine. If the engine is gone, the stream carries
    /// a single `Failed(Shutdown)`.
    pub fn submit(&self, admitted: Admitted) -> RequestHandle {
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = unbounded_channel();
        if let Err(mpsc::SendError(Command::Submit { events, .. })) =
            self.commands.send(Command::Submit {
                id,
                admitted,
                events: tx,
            })
        {
            let _ = events.send(Event::Failed(EngineError::Shutdown));
        }
        RequestHandle { id, events: rx }
    }

    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
    }
}

/// Checks the capacity promise, allocates the pool and starts the engine thread.
pub fn start(model: Model, config: EngineConfig) -> Result<EngineHandle, StartupError> {
    if !kv::CHECKS_ENABLED {
        return Err(StartupError::Config(
            "this build has the KV read checks compiled out (benchmark-only feature); it must not serve".into(),
        ));
    }
    if config.page_tokens == 0 || config.max_batch_tokens == 0 || config.max_running == 0 {
        return Err(StartupError::Config(
            "page size, batch tokens and running limit must be positive".into(),
        ));
    }
    let pages = config.pool_tokens.div_ceil(config.page_tokens);
    let pool_tokens = pages * config.page_tokens;
    let model_context = model.config.context_length;
    let max_context = match config.max_context {
        None => model_context.min(pool_tokens),
        Some(c) if c > pool_tokens => {
            return Err(StartupError::ContextExceedsPool {
                context: c,
                pool: pool_tokens,
            })
        }
        Some(c) if c > model_context => {
            return Err(StartupError::ContextExceedsModel {
                context: c,
                model: model_context,
            })
        }
        Some(c) => c,
    };
    let pool = KvPool::new(PoolConfig {
        layout: model.kv_layout(config.page_tokens, config.kv_dtype),
        pages,
        scrub: config.scrub,
    });
    let admission = Admission {
        max_context,
        vocab_size: model.config.vocab_size,
    };
    let (tx, rx) = mpsc::channel();
    let metrics: SharedMetrics = Arc::default();
    let cache = config.prefix_cache.then(|| {
        PrefixCache::with_public_prefixes(
            config.page_tokens,
            PublicPrefixes::new(config.public_prefixes.clone()),
        )
    });
    let worker = Worker {
        arrivals: 0,
        cache,
        model,
        pool: pool.clone(),
        config,
        metrics: metrics.clone(),
        waiting: VecDeque::new(),
        running: Vec::new(),
    };
    std::thread::Builder::new()
        .name("kvwarden-engine".into())
        .spawn(move || worker.run(rx))
        .map_err(|e| StartupError::Config(format!("cannot start engine thread: {e}")))?;
    Ok(EngineHandle {
        commands: tx,
        admission,
        pool,
        metrics,
        next_id: Arc::new(std::sync::atomic::AtomicU64::new(1)),
    })
}

/// Everything about a request except its pages: survives preemption.
struct Progress {
    id: RequestId,
    /// Arrival order: older requests are scheduled first and preempted last.
    arrival: u64,
    request: GenerateRequest,
    events: UnboundedSender<Event>,
    sampler: Sampler,
    /// Tokens emitted so far. The K/V of `prompt ++ output[..len-1]` is what a running
    /// request holds; after a preemption all of it is computed again.
    output: Vec<u32>,
    /// Prompt tokens served from the prefix cache when the request first ran.
    cached_tokens: Option<usize>,
    /// Prompt plus max_tokens: the most positions it can ever hold.
    total_tokens: usize,
    /// Fault injection only: positions declared written without being written.
    #[cfg(feature = "fault-injection")]
    fault_claim: usize,
}

impl Progress {
    fn stream_len(&self) -> usize {
        self.request.prompt.len() + self.output.len()
    }

    fn stream_token(&self, i: usize) -> u32 {
        let p = self.request.prompt.len();
        if i < p {
            self.request.prompt[i]
        } else {
            self.output[i - p]
        }
    }

    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.request.prompt.len(),
            completion_tokens: self.output.len(),
            cached_tokens: self.cached_tokens.unwrap_or(0),
        }
    }
}

/// A request holding pages. Dropping it releases them.
struct Running {
    progress: Progress,
    kv: SequenceKv,
}

impl Running {
    /// Tokens of the stream still to feed: the (rest of the) prompt or a replay after
    /// preemption, or the one token sampled last.
    fn remaining(&self) -> usize {
        self.progress.stream_len() - self.kv.len()
    }
}

/// How a running request leaves the running set.
enum Outcome {
    Continue,
    Done(Event),
}

struct Worker {
    arrivals: u64,
    /// Shared prompt pages, keyed by isolation domain.
    cache: Option<PrefixCache>,
    model: Model,
    pool: KvPool,
    config: EngineConfig,
    metrics: SharedMetrics,
    waiting: VecDeque<Progress>,
    /// In arrival order.
    running: Vec<Running>,
}

impl Worker {
    fn run(mut self, commands: mpsc::Receiver<Command>) {
        loop {
            // Idle: block for work. Busy: take whatever arrived and step.
            if self.waiting.is_empty() && self.running.is_empty() {
                match commands.recv() {
                    Ok(cmd) => {
                        if !self.accept(cmd) {
                            return;
                        }
                    }
                    Err(_) => return,
                }
            }
            loop {
                match commands.try_recv() {
                    Ok(cmd) => {
                        if !self.accept(cmd) {
                            return;
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        if self.waiting.is_empty() && self.running.is_empty() {
                            return;
                        }
                        break;
                    }
                }
            }
            self.step();
        }
    }

    /// Returns false on shutdown.
    fn accept(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit {
                id,
                admitted,
                events,
            } => {
                self.arrivals += 1;
                let total_tokens = admitted.total_tokens;
                #[cfg(feature = "fault-injection")]
                let fault_claim = admitted.fault_claim;
                let request = admitted.request;
                self.waiting.push_back(Progress {
                    #[cfg(feature = "fault-injection")]
                    fault_claim,
                    total_tokens,
                    id,
                    arrival: self.arrivals,
                    sampler: Sampler::new(request.sampling),
                    request,
                    events,
                    output: Vec::new(),
                    cached_tokens: None,
                });
                true
            }
            Command::Shutdown => {
                for w in self.waiting.drain(..) {
                    let _ = w.events.send(Event::Failed(EngineError::Shutdown));
                }
                for r in self.running.drain(..) {
                    let _ = r.progress.events.send(Event::Failed(EngineError::Shutdown));
                }
                false
            }
        }
    }

    fn drop_cancelled(&mut self) {
        let before = self.waiting.len() + self.running.len();
        self.waiting.retain(|w| !w.events.is_closed());
        self.running.retain(|r| !r.progress.events.is_closed());
        let cancelled = before - self.waiting.len() - self.running.len();
        EngineMetrics::add(&self.metrics.cancelled, cancelled as u64);
    }

    /// Frees pages: unreferenced cached prefixes first.
    fn make_room(&mut self, pages: usize) -> bool {
        let free = self.pool.counts().free;
        if pages <= free {
            return true;
        }
        if let Some(cache) = &mut self.cache {
            cache.evict(pages - free);
        }
        pages <= self.pool.counts().free
    }

    /// Moves waiting requests into the running set in arrival order, while the pool has
    /// room for their stream so far plus one page to grow into, and a spare page for each
    /// request already running.
    fn promote(&mut self) {
        while self.running.len() < self.config.max_running {
            let Some(head) = self.waiting.front() else {
                break;
            };
            let owner = Owner {
                request: head.id,
                domain: head.request.domain.clone(),
            };
            let stream: Vec<u32> = (0..head.stream_len())
                .map(|i| head.stream_token(i))
                .collect();
            // A cached prefix of the request's own domain (or a public one); the last token
            // of the stream is always computed, since sampling needs its logits.
            let prefix = match &mut self.cache {
                Some(cache) => {
                    let max_pages = (stream.len() - 1) / self.config.page_tokens;
                    cache.lookup(&owner.domain, &stream, max_pages)
                }
                None => kv::PrefixMatch::default(),
            };
            let cached = prefix.tokens();
            let mut kv = match SequenceKv::with_prefix(&self.pool, owner, prefix.into_pages()) {
                Ok(kv) => kv,
                Err(e) => {
                    // Unreachable unless the cache broke its contract: fail the request, loudly.
                    EngineMetrics::add(&self.metrics.isolation_failures, 1);
                    EngineMetrics::add(&self.metrics.failed, 1);
                    tracing::error!("prefix cache offered an unreadable page: {e}");
                    if let Some(w) = self.waiting.pop_front() {
                        let _ = w.events.send(Event::Failed(EngineError::Isolation(e)));
                    }
                    continue;
                }
            };
            let target = (stream.len() + self.config.page_tokens).min(head.total_tokens);
            let headroom = self.running.len();
            if !self.make_room(kv.pages_needed(target) + headroom) {
                break;
            }
            if let Err(e) = kv.reserve(target) {
                tracing::debug!("reservation deferred: {e}");
                break;
            }
            let Some(mut progress) = self.waiting.pop_front() else {
                break;
            };
            #[cfg(feature = "fault-injection")]
            if progress.fault_claim > 0 {
                kv.fault_claim_unwritten(progress.fault_claim);
            }
            if progress.cached_tokens.is_none() {
                progress.cached_tokens = Some(cached);
                EngineMetrics::add(
                    &self.metrics.prompt_tokens,
                    progress.request.prompt.len() as u64,
                );
                EngineMetrics::add(&self.metrics.cached_prompt_tokens, cached as u64);
            }
            self.running.push(Running { progress, kv });
        }
        self.running.sort_by_key(|r| r.progress.arrival);
        self.metrics
            .running
            .store(self.running.len() as u64, Ordering::Relaxed);
        self.metrics
            .waiting
            .store(self.waiting.len() as u64, Ordering::Relaxed);
    }

    /// Gives every running request the pages its next input needs, oldest first. When the
    /// pool is dry, the youngest running request is preempted (possibly the one asking).
    fn grow(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let need = {
                let r = &self.running[i];
                r.kv.pages_needed(r.progress.stream_len())
            };
            if need == 0 || self.make_room(need) {
                let r = &mut self.running[i];
                if r.kv.reserve(r.progress.stream_len()).is_ok() {
                    i += 1;
                    continue;
                }
            }
            let Some(victim) = self.running.pop() else {
                break;
            };
            self.preempt(victim);
            // `i` now indexes the same request, or is past the end if it was the victim.
        }
    }

    /// Returns a request's pages and puts it back at the head of the queue, to recompute.
    fn preempt(&mut self, r: Running) {
        EngineMetrics::add(&self.metrics.preemptions, 1);
        let Running { progress, kv } = r;
        drop(kv);
        let at = self
            .waiting
            .iter()
            .position(|w| w.arrival > progress.arrival)
            .unwrap_or(self.waiting.len());
        self.waiting.insert(at, progress);
    }

    /// Offers a request's full prompt pages to the prefix cache once its prompt is in KV.
    fn share_prompt(&mut self, i: usize) {
        let Some(cache) = &mut self.cache else {
            return;
        };
        let r = &mut self.running[i];
        let public = cache.public_pages(&r.progress.request.prompt);
        let pages = r.kv.share_full_pages_split(public);
        let prompt_pages = r.progress.request.prompt.len() / self.config.page_tokens;
        let pages = &pages[..pages.len().min(prompt_pages)];
        let visibility = Visibility::Domain(r.progress.request.domain.clone());
        if let Err(e) = cache.insert(&visibility, &r.progress.request.prompt, pages) {
            tracing::warn!("prompt pages not cached: {e}");
        }
    }

    fn step(&mut self) {
        self.drop_cancelled();
        self.promote();
        self.grow();
        if self.running.is_empty() {
            if !self.waiting.is_empty() {
                // Nothing running yet the head cannot be placed: only possible while pages
                // are still being returned by another thread. Back off briefly.
                std::thread::sleep(Duration::from_millis(1));
            }
            return;
        }
        EngineMetrics::add(&self.metrics.steps, 1);

        // Plan: decode rows first (one token each), then prefill and replay chunks in
        // arrival order within the token budget and the pages already reserved.
        let mut budget = self.config.max_batch_tokens;
        let mut plan: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
        for (i, r) in self.running.iter().enumerate() {
            if r.remaining() == 1 && budget > 0 {
                plan.push((i, r.kv.len()..r.kv.len() + 1));
                budget -= 1;
            }
        }
        for (i, r) in self.running.iter().enumerate() {
            if r.remaining() > 1 && budget > 0 {
                let start = r.kv.len();
                let end = (start + budget)
                    .min(r.progress.stream_len())
                    .min(r.kv.capacity());
                if end > start {
                    budget -= end - start;
                    plan.push((i, start..end));
                }
            }
        }

        let inputs: Vec<Vec<u32>> = plan
            .iter()
            .map(|(i, range)| {
                let p = &self.running[*i].progress;
                range.clone().map(|t| p.stream_token(t)).collect()
            })
            .collect();
        let results = {
            let mut slots: Vec<Option<&mut Running>> = self.running.iter_mut().map(Some).collect();
            let mut items: Vec<BatchItem<'_>> = Vec::with_capacity(plan.len());
            for ((i, range), tokens) in plan.iter().zip(&inputs) {
                let Some(r) = slots[*i].take() else {
                    continue;
                };
                let last = range.end == r.progress.stream_len();
                items.push(BatchItem {
                    kv: &mut r.kv,
                    tokens,
                    logits: if last {
                        LogitsWanted::Last
                    } else {
                        LogitsWanted::None
                    },
                });
            }
            self.model.forward(&mut items)
        };

        let mut outcomes: Vec<Outcome> =
            (0..self.running.len()).map(|_| Outcome::Continue).collect();
        for ((i, range), result) in plan.into_iter().zip(results) {
            let logits = match result {
                Ok(l) => l,
                Err(e) => {
                    let err = match e {
                        ModelError::Kv(k) => {
                            EngineMetrics::add(&self.metrics.isolation_failures, 1);
                            tracing::error!("isolation check failed: {k}");
                            EngineError::Isolation(k)
                        }
                        other => EngineError::Model(other.to_string()),
                    };
                    outcomes[i] = Outcome::Done(Event::Failed(err));
                    continue;
                }
            };
            let r = &mut self.running[i];
            if range.end < r.progress.stream_len() {
                continue;
            }
            let prompt_just_done = r.progress.output.is_empty();
            outcomes[i] = sample_next(&mut r.progress, &logits, &self.model.config, &self.metrics);
            if prompt_just_done {
                self.share_prompt(i);
            }
        }

        // Retire finished requests: the terminal event consumes the sender, the record's
        // drop releases the pages.
        let finished: Vec<(usize, Event)> = outcomes
            .into_iter()
            .enumerate()
            .filter_map(|(i, outcome)| match outcome {
                Outcome::Done(ev) => Some((i, ev)),
                Outcome::Continue => None,
            })
            .collect();
        for (i, ev) in finished.into_iter().rev() {
            let r = self.running.remove(i);
            match &ev {
                Event::Finished {
                    reason: FinishReason::Stop,
                    ..
                } => EngineMetrics::add(&self.metrics.finished_stop, 1),
                Event::Finished { .. } => EngineMetrics::add(&self.metrics.finished_length, 1),
                _ => EngineMetrics::add(&self.metrics.failed, 1),
            }
            finish(r, ev);
        }
        self.metrics
            .running
            .store(self.running.len() as u64, Ordering::Relaxed);
    }
}

/// Sends the terminal event and drops the request (and with it, its pages).
fn finish(r: Running, ev: Event) {
    let Running { progress, kv } = r;
    drop(kv);
    let _ = progress.events.send(ev);
}

fn sample_next(
    p: &mut Progress,
    logits: &[f32],
    config: &model::LlamaConfig,
    metrics: &EngineMetrics,
) -> Outcome {
    let vocab = config.vocab_size;
    if logits.len() != vocab {
        return Outcome::Done(Event::Failed(EngineError::Model(format!(
            "expected {vocab} logits, got {}",
            logits.len()
        ))));
    }
    let token = p.sampler.sample(logits);
    let eos = Some(token) == config.eos_token && !p.request.ignore_eos;
    if eos || p.request.stop_tokens.contains(&token) {
        return Outcome::Done(Event::Finished {
            reason: FinishReason::Stop,
            usage: p.usage(),
        });
    }
    let (logprob, top) = match p.request.logprobs {
        Some(k) => {
            let lp = log_softmax(logits);
            (Some(lp[token as usize]), top_logprobs(&lp, k))
        }
        None => (None, Vec::new()),
    };
    p.output.push(token);
    EngineMetrics::add(&metrics.generated_tokens, 1);
    let _ = p.events.send(Event::Token(TokenEvent {
        id: token,
        logprob,
        top_logprobs: top,
        cached_prompt_tokens: p.cached_tokens.unwrap_or(0),
    }));
    if p.output.len() >= p.request.max_tokens {
        return Outcome::Done(Event::Finished {
            reason: FinishReason::Length,
            usage: p.usage(),
        });
    }
    Outcome::Continue
}
