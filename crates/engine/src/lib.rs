//! The engine: admission, scheduling and the request lifecycle. It knows nothing of HTTP.
//!
//! Lifecycle, enforced by types:
//! * [`Admission::admit`] is the only way to make an [`Admitted`] request, and it checks
//!   every capacity limit before any resource exists. A [`Rejection`] has no method that
//!   leads anywhere but an error response.
//! * [`EngineHandle::submit`] consumes the `Admitted` value. Inside the engine a request's
//!   event sender is consumed by its terminal event (`Finished`, `Failed`), so nothing can
//!   be sent after a request has ended; dropping the request record releases its pages.
//! * A preempted request keeps its progress (emitted tokens, sampler state) and loses its
//!   pages; it recomputes them before going on.
//! * A client that stops listening (drops its [`RequestHandle`]) is cancelled at the next
//!   engine step and its pages go back to the pool then.

// Memory safety here rests on the compiler alone: the only unsafe code in the workspace is
// the SIMD kernels of the `model` crate and `gguf`'s mapping of the model file, each with
// its own safety argument and test.
#![forbid(unsafe_code)]

mod adapter;
mod admission;
mod command;
mod config;
#[cfg(feature = "fault-injection")]
pub mod fault;
mod handle;
pub mod handoff;
mod preemption;
mod slot;
mod speculation;
mod step_cost;
mod worker;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub use adapter::{AdapterInfo, AdapterRef, AdapterSetError, Adapters, Unloading};
pub use admission::{Admission, Admitted, Rejection};
pub use config::EngineConfig;
pub use handle::{start, start_with_draft, EngineHandle, RequestHandle, StartupError};
pub use slot::QueueFull;
pub use speculation::{DraftModel, SpeculationConfig, SpeculationMode, AUTO_MAX_ROWS};

pub use kv::{IsolationDomain, KvDtype, RequestId};
pub use model::{Penalties, SamplingParams};

/// What the engine needs from a model: its shape and one batched forward step.
/// [`model::Model`] is the one that serves; tests wrap it to make a step fail.
pub trait StepModel: Send + Sync + 'static {
    fn config(&self) -> &model::LlamaConfig;
    fn kv_layout(&self, page_tokens: usize, dtype: kv::KvDtype) -> kv::KvLayout;
    /// One step over a batch; see [`model::Model::forward`]. A panic fails the step's
    /// requests, not the engine (up to a limit, see [`crate::start`]).
    fn forward(
        &self,
        items: &mut [model::BatchItem<'_>],
    ) -> Vec<Result<model::Logits, model::ModelError>>;
    /// [`Self::forward`], calling `between_layers` where the step may pause for another
    /// (see [`model::Model::forward_yielding`]); a model that never pauses ignores it.
    fn forward_yielding(
        &self,
        items: &mut [model::BatchItem<'_>],
        between_layers: &mut (dyn FnMut() + Send),
    ) -> Vec<Result<model::Logits, model::ModelError>> {
        let _ = between_layers;
        self.forward(items)
    }
}

impl StepModel for model::Model {
    fn config(&self) -> &model::LlamaConfig {
        &self.config
    }

    fn kv_layout(&self, page_tokens: usize, dtype: kv::KvDtype) -> kv::KvLayout {
        model::Model::kv_layout(self, page_tokens, dtype)
    }

    fn forward(
        &self,
        items: &mut [model::BatchItem<'_>],
    ) -> Vec<Result<model::Logits, model::ModelError>> {
        model::Model::forward(self, items)
    }

    fn forward_yielding(
        &self,
        items: &mut [model::BatchItem<'_>],
        between_layers: &mut (dyn FnMut() + Send),
    ) -> Vec<Result<model::Logits, model::ModelError>> {
        model::Model::forward_yielding(self, items, between_layers)
    }
}

/// What a client asked the engine to do, after the server validated and tokenized it.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub domain: IsolationDomain,
    /// The tenant's weight (0 counts as 1): when tenants compete, their shares of the
    /// running slots, of each step's prefill budget and of the pool under preemption are
    /// in proportion to their weights. Every request of one tenant carries the same one.
    pub weight: u32,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Keep generating past EOS until `max_tokens`.
    pub ignore_eos: bool,
    /// `Some(k)`: report each token's log-probability and the `k` most likely alternatives.
    pub logprobs: Option<usize>,
    /// A structured output's constraint, compiled for this request alone (never shared or
    /// cached; a clone is a deep copy): each token is sampled from its mask, and the
    /// request ends when the constraint is complete.
    pub constraint: Option<constraint::RowConstraint>,
    /// The LoRA adapter the request is computed under (`None`: the base model). The engine
    /// narrows the request's domain by its fingerprint at submission
    /// (`kv::IsolationDomain::computed_under`), so K/V computed under it is cached, shared
    /// and handed off only within that adapter and tenant. Held until the request ends: an
    /// adapter unloaded meanwhile is freed only then.
    pub adapter: Option<AdapterRef>,
}

/// One generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    pub id: u32,
    pub logprob: Option<f32>,
    pub top_logprobs: Vec<(u32, f32)>,
    /// Prompt tokens served from the prefix cache (the same on every token of a request).
    pub cached_prompt_tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS (or, as the server reports it, a stop string).
    Stop,
    /// `max_tokens` reached.
    Length,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache of the request's own domain.
    pub cached_tokens: usize,
}

/// Everything the engine tells a client about its request. A stream ends with exactly one
/// `Finished` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token(TokenEvent),
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    Failed(EngineError),
    /// Prefill role only ([`EngineHandle::submit_prefill`]): the terminal event, carrying
    /// the prompt's K/V and the first token for a decode node.
    Prefilled(Box<handoff::PrefillOutput>),
}

/// Failures after admission. Each ends its request with an error, never a partial success.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// A KV ownership or extent check refused an access: a bug caught, not a data leak.
    #[error("KV isolation check failed: {0}")]
    Isolation(kv::KvError),
    #[error("model error: {0}")]
    Model(String),
    #[error("the engine is shutting down")]
    Shutdown,
    /// The request's constraint failed while generating (its per-token budget, or a
    /// token another node sent that it does not allow).
    #[error("{0}")]
    Constraint(String),
    /// Disaggregated mode: a node, the link to it, or the K/V handoff failed. `reason` is
    /// the failure's label (checksum, coverage, manifest, timeout, peer_gone, ...).
    #[error("{reason}: {message}")]
    Remote { reason: String, message: String },
}

/// Counters of the engine's work, which the server exposes on `/metrics`. Monotonic unless
/// named otherwise. Requests are counted once, by how their client saw them end, and that
/// is the server's count: the engine cannot tell a client that went away from one whose
/// stop string matched.
#[derive(Debug, Default)]
pub struct EngineMetrics {
    pub isolation_failures: AtomicU64,
    /// Prompt tokens of requests the engine started (once per request, however many times
    /// it was preempted and recomputed).
    pub prompt_tokens: AtomicU64,
    /// Tokens sampled, including any the server then dropped after a stop string.
    pub generated_tokens: AtomicU64,
    pub cached_prompt_tokens: AtomicU64,
    pub steps: AtomicU64,
    /// Steps paused between two layers to compute the first tokens of requests that
    /// arrived meanwhile from tenants running fewer than the heaviest (`worker::pause`).
    pub paused_steps: AtomicU64,
    /// Requests that gave their pages back to let older ones grow, and recomputed later.
    pub preemptions: AtomicU64,
    /// Tokens sampled under a structured output's mask, the microseconds spent computing
    /// those masks (on a thread beside the forward pass), and the microseconds the engine
    /// waited for them after its forward pass had finished: what constraints cost the
    /// batch, which the forward pass did not hide.
    pub constrained_tokens: AtomicU64,
    pub mask_micros: AtomicU64,
    pub mask_wait_micros: AtomicU64,
    /// Speculative decoding: draft tokens fed to verification, and those of them kept
    /// (each kept one is a token plain decoding would have produced).
    pub draft_tokens: AtomicU64,
    pub accepted_draft_tokens: AtomicU64,
    /// Gauges.
    pub running: AtomicU64,
    pub waiting: AtomicU64,
}

impl EngineMetrics {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

pub type SharedMetrics = Arc<EngineMetrics>;
