//! The engine thread: continuous batching with chunked prefill mixed into decode steps.
//!
//! Pages are reserved as a request grows, never read before they are written. Full-pool
//! policy: preempt and recompute. When a running request needs a page and neither the free
//! list nor the prefix cache has one, a younger request (the youngest of the tenant holding
//! the most pages: `crate::preemption`) gives all of its pages back and returns to the
//! queue in its arrival place with what it has generated; later it
//! recomputes that K/V (bit for bit the same: rows do not depend on the batch) and goes on.
//! Nothing ever runs on partial KV. Admission guarantees each request fits the pool alone,
//! and the oldest request is never preempted for a younger one, so every request finishes.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use kv::{KvPool, Owner, PrefixCache, RequestId, SequenceKv, Visibility};
use model::sampling::{log_softmax, top_logprobs};
use model::{BatchItem, LogitsWanted, ModelError, Sampler};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use crate::admission::Admitted;
use crate::handle::{Command, EngineConfig, Lifecycle, Slot};
use crate::handoff::{ImportReservation, PrefillOutput, ReserveError, Ticket, VerifiedImport};
use crate::preemption::{self, Holding};
use crate::{
    EngineError, EngineMetrics, Event, FinishReason, GenerateRequest, SharedMetrics, StepModel,
    TokenEvent, Usage,
};

/// Consecutive forward steps that may panic before the engine gives up: one panic is a bug
/// hit by some batch, and the engine goes on without that batch's requests; a panic at
/// every step means nothing can be served, and the engine stops so that `/health` says so.
const MAX_CONSECUTIVE_PANICS: u32 = 3;

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
    /// The request's place in the engine, freed when the request ends.
    slot: Slot,
    /// Prefill role: end after the first token with the prompt's K/V.
    prefill_only: bool,
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

    /// Ends the request with its terminal event. Its place in the engine is freed first, so
    /// a client that reads the end can submit again at once.
    fn end(self, ev: Event) {
        let Progress { events, slot, .. } = self;
        drop(slot);
        let _ = events.send(ev);
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

pub(crate) struct Worker {
    arrivals: u64,
    /// Shared prompt pages, keyed by isolation domain.
    cache: Option<PrefixCache>,
    model: Box<dyn StepModel>,
    pool: KvPool,
    config: EngineConfig,
    metrics: SharedMetrics,
    waiting: VecDeque<Progress>,
    /// In arrival order.
    running: Vec<Running>,
    lifecycle: Arc<Lifecycle>,
    /// Forward steps in a row that panicked.
    panics_in_a_row: u32,
    /// Decode role: reservations for K/V that other nodes will send, first come first
    /// served, before any waiting request is placed.
    reservations: VecDeque<PendingReservation>,
}

struct PendingReservation {
    id: RequestId,
    admitted: Admitted,
    request_id: String,
    slot: Slot,
    reply: oneshot::Sender<Result<ImportReservation, ReserveError>>,
}

impl Worker {
    pub(crate) fn new(
        model: Box<dyn StepModel>,
        pool: KvPool,
        config: EngineConfig,
        metrics: SharedMetrics,
        cache: Option<PrefixCache>,
        lifecycle: Arc<Lifecycle>,
    ) -> Self {
        Self {
            arrivals: 0,
            cache,
            model,
            pool,
            config,
            metrics,
            waiting: VecDeque::new(),
            running: Vec::new(),
            lifecycle,
            panics_in_a_row: 0,
            reservations: VecDeque::new(),
        }
    }

    pub(crate) fn run(mut self, commands: mpsc::Receiver<Command>) {
        loop {
            if self.lifecycle.stopping.load(Ordering::Acquire) {
                self.fail_all(&EngineError::Shutdown);
                return;
            }
            // Idle: block for work. Busy: take whatever arrived and step.
            if self.idle() {
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
                        if self.idle() {
                            return;
                        }
                        break;
                    }
                }
            }
            if !self.step() {
                return;
            }
        }
    }

    fn idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.reservations.is_empty()
    }

    /// Returns false on shutdown.
    fn accept(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit {
                id,
                admitted,
                events,
                slot,
                prefill_only,
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
                    slot,
                    prefill_only,
                });
                true
            }
            Command::Reserve {
                id,
                admitted,
                request_id,
                slot,
                reply,
            } => {
                self.reservations.push_back(PendingReservation {
                    id,
                    admitted,
                    request_id,
                    slot,
                    reply,
                });
                self.place_reservations();
                true
            }
            Command::SubmitImport { verified, events } => {
                self.start_import(verified, events);
                true
            }
            Command::Shutdown => {
                if self.lifecycle.stopping.load(Ordering::Acquire) {
                    self.fail_all(&EngineError::Shutdown);
                    return false;
                }
                true
            }
        }
    }

    /// Ends every request with `error`.
    fn fail_all(&mut self, error: &EngineError) {
        for w in self.waiting.drain(..) {
            w.end(Event::Failed(error.clone()));
        }
        for r in self.running.drain(..) {
            finish(r, Event::Failed(error.clone()));
        }
        for r in self.reservations.drain(..) {
            let _ = r.reply.send(Err(ReserveError::Engine(error.clone())));
        }
    }

    /// Gives pending reservations their pages, in order, while the pool (after evicting
    /// unused cached prefixes) has room for a whole prompt.
    fn place_reservations(&mut self) {
        self.reservations.retain(|r| !r.reply.is_closed());
        while let Some(head) = self.reservations.front() {
            let request = head.admitted.request();
            let owner = Owner {
                request: head.id,
                domain: request.domain.clone(),
            };
            let prompt_len = request.prompt.len();
            let domain = owner.domain.clone();
            let mut kv = SequenceKv::new(&self.pool, owner);
            if !self.make_room(kv.pages_needed(prompt_len), &domain)
                || kv.reserve(prompt_len).is_err()
            {
                break;
            }
            let Some(r) = self.reservations.pop_front() else {
                break;
            };
            let reservation = ImportReservation {
                id: r.id,
                ticket: Ticket::random(),
                request_id: r.request_id,
                admitted: r.admitted,
                kv,
                vocab_size: self.model.config().vocab_size,
                slot: r.slot,
            };
            // A requester that left drops the reservation, and with it the pages.
            let _ = r.reply.send(Ok(reservation));
        }
    }

    /// Decode role: a verified sequence joins the running set with its prompt's K/V in
    /// place, and the prefill node's first token is accepted as if sampled here.
    fn start_import(&mut self, verified: VerifiedImport, events: UnboundedSender<Event>) {
        let VerifiedImport {
            id,
            admitted,
            kv,
            first_token,
            sampler_state,
            cached_tokens,
            slot,
        } = verified;
        self.arrivals += 1;
        let total_tokens = admitted.total_tokens;
        let request = admitted.request;
        // Prompt tokens are the prefill node's count: it computed them.
        let mut progress = Progress {
            id,
            arrival: self.arrivals,
            sampler: Sampler::resume(request.sampling, sampler_state),
            request,
            events,
            output: Vec::new(),
            cached_tokens: Some(cached_tokens),
            total_tokens,
            slot,
            prefill_only: false,
            #[cfg(feature = "fault-injection")]
            fault_claim: 0,
        };
        match accept_token(
            &mut progress,
            first_token,
            self.model.config(),
            &self.metrics,
        ) {
            Outcome::Continue => self.running.push(Running { progress, kv }),
            Outcome::Done(ev) => finish(Running { progress, kv }, ev),
        }
    }

    /// Drops the requests whose client stopped listening. Why it stopped (it went away, or
    /// the server matched a stop string) is the server's to count, not the engine's.
    fn drop_cancelled(&mut self) {
        self.waiting.retain(|w| !w.events.is_closed());
        self.running.retain(|r| !r.progress.events.is_closed());
    }

    /// Frees pages for a request of `domain` by evicting cached prefixes that no request
    /// uses (its own tenant's first when it holds the most: `kv::PrefixCache::evict_for`),
    /// if that can make enough room. Cheap when it cannot (the head of the queue may wait
    /// many steps): the cache counts its evictable pages, so nothing is scanned and nothing
    /// is evicted in vain.
    fn make_room(&mut self, pages: usize, domain: &kv::IsolationDomain) -> bool {
        let free = self.pool.counts().free;
        if pages <= free {
            return true;
        }
        if let Some(cache) = &mut self.cache {
            if free + cache.evictable_pages() >= pages {
                cache.evict_for(pages - free, domain);
            }
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
                    tracing::error!("prefix cache offered an unreadable page: {e}");
                    if let Some(w) = self.waiting.pop_front() {
                        w.end(Event::Failed(EngineError::Isolation(e)));
                    }
                    continue;
                }
            };
            let target = (stream.len() + self.config.page_tokens).min(head.total_tokens);
            let headroom = self.running.len();
            let domain = kv.owner().domain.clone();
            if !self.make_room(kv.pages_needed(target) + headroom, &domain) {
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
    /// pool is dry, a younger request is preempted (the one asking, if it is the youngest),
    /// chosen fairly between tenants (`crate::preemption::victim`).
    fn grow(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let need = {
                let r = &self.running[i];
                r.kv.pages_needed(r.progress.stream_len())
            };
            // The domain is cloned only at a page boundary, not at every step.
            let room = need == 0 || {
                let domain = self.running[i].progress.request.domain.clone();
                self.make_room(need, &domain)
            };
            if room {
                let r = &mut self.running[i];
                if r.kv.reserve(r.progress.stream_len()).is_ok() {
                    i += 1;
                    continue;
                }
            }
            let holdings: Vec<Holding<'_>> = self
                .running
                .iter()
                .map(|r| Holding {
                    tenant: r.progress.request.domain.tenant_name(),
                    pages: r.kv.owned_pages(),
                })
                .collect();
            let Some(v) = preemption::victim(&holdings, i) else {
                break;
            };
            let victim = self.running.remove(v);
            self.preempt(victim);
            // The victim is `i` or younger: `i` now indexes the same request, or the next
            // one if it was the victim, or is past the end.
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

    /// Returns false when the engine must stop.
    fn step(&mut self) -> bool {
        self.drop_cancelled();
        self.place_reservations();
        self.promote();
        self.grow();
        if self.running.is_empty() {
            if !self.waiting.is_empty() || !self.reservations.is_empty() {
                // Nothing running yet the head cannot be placed: only possible while pages
                // are still being returned by another thread. Back off briefly.
                std::thread::sleep(Duration::from_millis(1));
            }
            return true;
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
            // A panic in the model must not take the engine thread (and every other
            // request) with it. The model keeps no state between steps, so unwinding out
            // of one leaves nothing half-done but this step's requests, which fail below.
            let model = &self.model;
            catch_unwind(AssertUnwindSafe(|| model.forward(&mut items)))
        };
        let results = match results {
            Ok(results) => {
                self.panics_in_a_row = 0;
                results
            }
            Err(panic) => return self.step_panicked(&plan, panic.as_ref()),
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
            outcomes[i] = if r.progress.prefill_only {
                hand_over(r, &logits, self.model.config())
            } else {
                sample_next(&mut r.progress, &logits, self.model.config(), &self.metrics)
            };
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
            finish(r, ev);
        }
        self.metrics
            .running
            .store(self.running.len() as u64, Ordering::Relaxed);
        true
    }

    /// Fails the requests of a step whose forward pass panicked; their pages are dropped
    /// with them (whatever the step wrote is never read). Returns false when too many steps
    /// in a row panicked: then every request fails and the engine stops.
    fn step_panicked(
        &mut self,
        plan: &[(usize, std::ops::Range<usize>)],
        panic: &(dyn std::any::Any + Send),
    ) -> bool {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".into());
        self.panics_in_a_row += 1;
        tracing::error!(
            "the forward pass panicked ({} in a row): {what}",
            self.panics_in_a_row
        );
        let error = EngineError::Model(format!("the forward pass panicked: {what}"));
        let mut failed: Vec<usize> = plan.iter().map(|(i, _)| *i).collect();
        failed.sort_unstable();
        failed.dedup();
        for i in failed.into_iter().rev() {
            let r = self.running.remove(i);
            finish(r, Event::Failed(error.clone()));
        }
        if self.panics_in_a_row >= MAX_CONSECUTIVE_PANICS {
            tracing::error!("the forward pass keeps panicking; the engine stops");
            self.fail_all(&error);
            return false;
        }
        self.metrics
            .running
            .store(self.running.len() as u64, Ordering::Relaxed);
        true
    }
}

/// Sends the terminal event and drops the request (and with it, its pages).
fn finish(r: Running, ev: Event) {
    let Running { progress, kv } = r;
    drop(kv);
    progress.end(ev);
}

fn sampled_token(
    p: &mut Progress,
    logits: &[f32],
    config: &model::LlamaConfig,
) -> Result<TokenEvent, Event> {
    let vocab = config.vocab_size;
    if logits.len() != vocab {
        return Err(Event::Failed(EngineError::Model(format!(
            "expected {vocab} logits, got {}",
            logits.len()
        ))));
    }
    let token = p.sampler.sample(logits);
    let (logprob, top) = match p.request.logprobs {
        Some(k) => {
            let lp = log_softmax(logits);
            (Some(lp[token as usize]), top_logprobs(&lp, k))
        }
        None => (None, Vec::new()),
    };
    Ok(TokenEvent {
        id: token,
        logprob,
        top_logprobs: top,
        cached_prompt_tokens: p.cached_tokens.unwrap_or(0),
    })
}

fn sample_next(
    p: &mut Progress,
    logits: &[f32],
    config: &model::LlamaConfig,
    metrics: &EngineMetrics,
) -> Outcome {
    match sampled_token(p, logits, config) {
        Ok(token) => accept_token(p, token, config, metrics),
        Err(failed) => Outcome::Done(failed),
    }
}

/// Prefill role: the first token and the prompt's K/V, read back through the same checks
/// as attention, end the request.
fn hand_over(r: &mut Running, logits: &[f32], config: &model::LlamaConfig) -> Outcome {
    let first = match sampled_token(&mut r.progress, logits, config) {
        Ok(token) => token,
        Err(failed) => return Outcome::Done(failed),
    };
    let prompt = &r.progress.request.prompt;
    match r.kv.export_pages(prompt.len()) {
        Ok(pages) => Outcome::Done(Event::Prefilled(Box::new(PrefillOutput {
            first,
            sampler_state: r.progress.sampler.state(),
            prompt: prompt.clone(),
            page_tokens: r.kv.layout().page_tokens,
            pages,
            cached_tokens: r.progress.cached_tokens.unwrap_or(0),
        }))),
        Err(e) => Outcome::Done(Event::Failed(EngineError::Isolation(e))),
    }
}

/// Applies a sampled token: the end of the stream (EOS, a stop token, `max_tokens`), or
/// one more token event for the client.
fn accept_token(
    p: &mut Progress,
    token: TokenEvent,
    config: &model::LlamaConfig,
    metrics: &EngineMetrics,
) -> Outcome {
    let id = token.id;
    let eos = Some(id) == config.eos_token && !p.request.ignore_eos;
    if eos {
        return Outcome::Done(Event::Finished {
            reason: FinishReason::Stop,
            usage: p.usage(),
        });
    }
    p.output.push(id);
    EngineMetrics::add(&metrics.generated_tokens, 1);
    let _ = p.events.send(Event::Token(token));
    if p.output.len() >= p.request.max_tokens {
        return Outcome::Done(Event::Finished {
            reason: FinishReason::Length,
            usage: p.usage(),
        });
    }
    Outcome::Continue
}
