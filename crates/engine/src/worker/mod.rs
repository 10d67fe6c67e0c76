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
//!
//! Running slots are shared between tenants: the next request to run is the oldest of the
//! tenant running the fewest, and when every slot is taken a tenant running two or more
//! than a waiting request's tenant gives its youngest request's slot back
//! (`crate::preemption::slot_victim`, the same preempt-and-recompute). Such a tenant keeps
//! its own oldest request running, so each tenant's requests still all finish.

mod draft;
mod event_loop;
mod import;
mod pause;
mod sample;
mod schedule;
mod step;

use std::collections::VecDeque;
use std::sync::{mpsc, Arc};

use kv::{KvPool, PrefixCache, RequestId, SequenceKv};
use model::Sampler;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use crate::admission::Admitted;
use crate::command::{Command, Lifecycle};
use crate::config::EngineConfig;
use crate::handoff::{ImportReservation, ReserveError};
use crate::slot::Slot;
use crate::{EngineError, Event, GenerateRequest, SharedMetrics, StepModel, Usage};

/// Everything about a request except its pages: survives preemption.
struct Progress {
    id: RequestId,
    /// Arrival order: older requests are scheduled first and preempted last.
    arrival: u64,
    request: GenerateRequest,
    events: UnboundedSender<Event>,
    sampler: Sampler,
    /// The mask for the next token of a constrained request, computed beside the forward
    /// pass that produces its logits (taken by the sampling step).
    next_mask: Option<Result<constraint::TokenMask, constraint::ConstraintError>>,
    /// Speculative decoding's per-request state, built from this request's stream alone.
    drafter: crate::speculation::Drafter,
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
    /// The draft model's K/V of a prefix of the stream (`draft::DraftWorker`), in pages of
    /// the draft pool leased to this request; made when the request first drafts.
    draft_kv: Option<SequenceKv>,
}

impl Running {
    fn new(progress: Progress, kv: SequenceKv) -> Self {
        Self {
            progress,
            kv,
            draft_kv: None,
        }
    }

    /// Gives every page back, the model's and the draft model's, before anything is said
    /// about the request: what is left is its progress.
    fn release(self) -> Progress {
        let Running {
            progress,
            kv,
            draft_kv,
        } = self;
        drop((kv, draft_kv));
        progress
    }

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
    /// Shared with the closure a step's forward pass calls between layers (`pause.rs`).
    model: Arc<dyn StepModel>,
    pool: KvPool,
    config: EngineConfig,
    metrics: SharedMetrics,
    waiting: VecDeque<Progress>,
    /// In arrival order.
    running: Vec<Running>,
    lifecycle: Arc<Lifecycle>,
    /// Forward steps in a row that panicked.
    panics_in_a_row: u32,
    /// Whether the last step computed only lighter tenants' first tokens (see `step`):
    /// such a step never follows another, so decode rows wait at most one short step.
    first_tokens_last: bool,
    /// Decode role: reservations for K/V that other nodes will send, first come first
    /// served, before any waiting request is placed.
    reservations: VecDeque<PendingReservation>,
    /// How long a prompt chunk may be at its depth (`Worker::plan`).
    cost: crate::step_cost::StepCost,
    /// The draft model, when drafts come from one rather than from prompt lookup.
    draft: Option<draft::DraftWorker>,
    /// The commands' channel, once the loop runs; a paused step takes what arrived.
    commands: Option<mpsc::Receiver<Command>>,
    /// Commands a paused step took but leaves to the loop, in arrival order.
    deferred: VecDeque<Command>,
    /// Requests placed, and given their first token, while a step was paused: they join
    /// `running` when the step ends.
    early: Vec<Running>,
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
        draft: Option<(Box<dyn StepModel>, KvPool, f32)>,
    ) -> Self {
        Self {
            arrivals: 0,
            cache,
            cost: crate::step_cost::StepCost::of(model.config(), config.max_batch_tokens),
            model: Arc::from(model),
            pool,
            config,
            metrics,
            waiting: VecDeque::new(),
            running: Vec::new(),
            lifecycle,
            panics_in_a_row: 0,
            first_tokens_last: false,
            reservations: VecDeque::new(),
            draft: draft.map(|(model, pool, cost)| draft::DraftWorker { model, pool, cost }),
            commands: None,
            deferred: VecDeque::new(),
            early: Vec::new(),
        }
    }

    /// Ends every request with `error`.
    fn fail_all(&mut self, error: &EngineError) {
        for w in self.waiting.drain(..) {
            w.end(Event::Failed(error.clone()));
        }
        for r in self.running.drain(..).chain(self.early.drain(..)) {
            finish(r, Event::Failed(error.clone()));
        }
        for r in self.reservations.drain(..) {
            let _ = r.reply.send(Err(ReserveError::Engine(error.clone())));
        }
    }
}

/// Sends the terminal event and drops the request (and with it, its pages).
fn finish(r: Running, ev: Event) {
    r.release().end(ev);
}
