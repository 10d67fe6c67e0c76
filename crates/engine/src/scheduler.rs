//! The engine thread: continuous batching with chunked prefill mixed into decode steps.
//!
//! Full-pool policy: wait. A request enters the running set only once every page it may
//! ever need (prompt + max_tokens) is reserved, so nothing ever runs on partial KV and
//! nothing is preempted. Admission guarantees each request fits the pool on its own, so
//! the head of the queue always runs once enough others finish.

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
    #[error("--max-context {context} exceeds the KV pool capacity of {pool} tokens: a request of the advertised length could not be held. Enlarge --kv-pool-tokens to at least {context} or lower --max-context.")]
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

struct Waiting {
    id: RequestId,
    admitted: Admitted,
    events: UnboundedSender<Event>,
}

/// A request holding its pages. Dropping it releases them.
struct Running {
    request: GenerateRequest,
    events: UnboundedSender<Event>,
    kv: SequenceKv,
    sampler: Sampler,
    /// Prompt tokens whose K/V is in `kv`.
    prefilled: usize,
    /// The last sampled token, fed back at the next step.
    pending: Option<u32>,
    generated: usize,
    cached_tokens: usize,
}

impl Running {
    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.request.prompt.len(),
            completion_tokens: self.generated,
            cached_tokens: self.cached_tokens,
        }
    }
}

/// How a running request leaves the running set.
enum Outcome {
    Continue,
    Done(Event),
}

struct Worker {
    /// Shared prompt pages, keyed by isolation domain.
    cache: Option<PrefixCache>,
    model: Model,
    pool: KvPool,
    config: EngineConfig,
    metrics: SharedMetrics,
    waiting: VecDeque<Waiting>,
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
                self.waiting.push_back(Waiting {
                    id,
                    admitted,
                    events,
                });
                true
            }
            Command::Shutdown => {
                for w in self.waiting.drain(..) {
                    let _ = w.events.send(Event::Failed(EngineError::Shutdown));
                }
                for r in self.running.drain(..) {
                    let _ = r.events.send(Event::Failed(EngineError::Shutdown));
                }
                false
            }
        }
    }

    fn drop_cancelled(&mut self) {
        let before = self.waiting.len() + self.running.len();
        self.waiting.retain(|w| !w.events.is_closed());
        self.running.retain(|r| !r.events.is_closed());
        let cancelled = before - self.waiting.len() - self.running.len();
        EngineMetrics::add(&self.metrics.cancelled, cancelled as u64);
    }

    /// Moves waiting requests into the running set, first come first served, while their
    /// whole reservation fits.
    fn promote(&mut self) {
        while self.running.len() < self.config.max_running {
            let Some(head) = self.waiting.front() else {
                break;
            };
            let request = &head.admitted.request;
            let total = head.admitted.total_tokens;
            let owner = Owner {
                request: head.id,
                domain: request.domain.clone(),
            };
            // A cached prefix of the request's own domain (or a public one); the last prompt
            // token is always computed, since sampling needs its logits.
            let prefix = match &mut self.cache {
                Some(cache) => {
                    let max_pages = (request.prompt.len() - 1) / self.config.page_tokens;
                    cache.lookup(&owner.domain, &request.prompt, max_pages)
                }
                None => kv::PrefixMatch::default(),
            };
            let cached_tokens = prefix.tokens();
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
            let needed = kv.pages_needed(total);
            let free = self.pool.counts().free;
            if needed > free {
                if let Some(cache) = &mut self.cache {
                    cache.evict(needed - free);
                }
                if needed > self.pool.counts().free {
                    break;
                }
            }
            if let Err(e) = kv.reserve(total) {
                tracing::debug!("reservation deferred: {e}");
                break;
            }
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            let request = w.admitted.request;
            EngineMetrics::add(&self.metrics.prompt_tokens, request.prompt.len() as u64);
            EngineMetrics::add(&self.metrics.cached_prompt_tokens, cached_tokens as u64);
            self.running.push(Running {
                sampler: Sampler::new(request.sampling),
                request,
                events: w.events,
                kv,
                prefilled: cached_tokens,
                pending: None,
                generated: 0,
                cached_tokens,
            });
        }
        self.metrics
            .running
            .store(self.running.len() as u64, Ordering::Relaxed);
        self.metrics
            .waiting
            .store(self.waiting.len() as u64, Ordering::Relaxed);
    }

    /// Offers a request's full prompt pages to the prefix cache once its prompt is in KV.
    fn share_prompt(&mut self, i: usize) {
        let Some(cache) = &mut self.cache else { return };
        let r = &mut self.running[i];
        let public = cache.public_pages(&r.request.prompt);
        let pages = r.kv.share_full_pages_split(public);
        let visibility = Visibility::Domain(r.request.domain.clone());
        if let Err(e) = cache.insert(&visibility, &r.request.prompt, &pages) {
            tracing::warn!("prompt pages not cached: {e}");
        }
    }

    fn step(&mut self) {
        self.drop_cancelled();
        self.promote();
        if self.running.is_empty() {
            if !self.waiting.is_empty() {
                // Nothing running yet the head cannot be placed: only possible while pages
                // are still being returned by another thread. Back off briefly.
                std::thread::sleep(Duration::from_millis(1));
            }
            return;
        }
        EngineMetrics::add(&self.metrics.steps, 1);

        // Plan: decode rows first (one token each), then prefill chunks in arrival order
        // within the token budget.
        let mut budget = self.config.max_batch_tokens;
        let mut plan: Vec<(usize, std::ops::Range<usize>, bool)> = Vec::new(); // (running idx, prompt range or empty for decode, wants logits)
        for (i, r) in self.running.iter().enumerate() {
            if r.pending.is_some() && budget > 0 {
                plan.push((i, 0..0, true));
                budget -= 1;
            }
        }
        for (i, r) in self.running.iter().enumerate() {
            if r.pending.is_none() && r.prefilled < r.request.prompt.len() && budget > 0 {
                let end = (r.prefilled + budget).min(r.request.prompt.len());
                budget -= end - r.prefilled;
                plan.push((i, r.prefilled..end, end == r.request.prompt.len()));
            }
        }

        let decode_tokens: Vec<[u32; 1]> = plan
            .iter()
            .map(|&(i, _, _)| [self.running[i].pending.unwrap_or(0)])
            .collect();
        let results = {
            let mut slots: Vec<Option<&mut Running>> = self.running.iter_mut().map(Some).collect();
            let mut items: Vec<BatchItem<'_>> = Vec::with_capacity(plan.len());
            for (p, (i, range, wants)) in plan.iter().enumerate() {
                let Some(r) = slots[*i].take() else { continue };
                let tokens: &[u32] = if range.is_empty() {
                    &decode_tokens[p]
                } else {
                    &r.request.prompt[range.clone()]
                };
                items.push(BatchItem {
                    kv: &mut r.kv,
                    tokens,
                    logits: if *wants {
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
        for ((i, range, wants), result) in plan.into_iter().zip(results) {
            let r = &mut self.running[i];
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
            if range.is_empty() {
                r.pending = None;
            } else {
                r.prefilled = range.end;
            }
            if !wants {
                continue;
            }
            outcomes[i] = sample_next(r, &logits, &self.model.config, &self.metrics);
            if !range.is_empty() {
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
            let r = self.running.swap_remove(i);
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
    let Running { events, kv, .. } = r;
    drop(kv);
    let _ = events.send(ev);
}

fn sample_next(
    r: &mut Running,
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
    let token = r.sampler.sample(logits);
    let eos = Some(token) == config.eos_token && !r.request.ignore_eos;
    if eos || r.request.stop_tokens.contains(&token) {
        return Outcome::Done(Event::Finished {
            reason: FinishReason::Stop,
            usage: r.usage(),
        });
    }
    let (logprob, top) = match r.request.logprobs {
        Some(k) => {
            let lp = log_softmax(logits);
            (Some(lp[token as usize]), top_logprobs(&lp, k))
        }
        None => (None, Vec::new()),
    };
    r.generated += 1;
    EngineMetrics::add(&metrics.generated_tokens, 1);
    let _ = r.events.send(Event::Token(TokenEvent {
        id: token,
        logprob,
        top_logprobs: top,
    }));
    if r.generated >= r.request.max_tokens {
        return Outcome::Done(Event::Finished {
            reason: FinishReason::Length,
            usage: r.usage(),
        });
    }
    r.pending = Some(token);
    Outcome::Continue
}
