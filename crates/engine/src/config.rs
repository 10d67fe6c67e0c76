//! What an engine is started with: pool, batch and queue sizes, and prefix sharing.

use kv::{KvDtype, ScrubPolicy};

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
    /// Requests computed in one step; up to an eighth more (at least one) for tenants
    /// running fewer than their share, instead of preempting a heavier tenant's request.
    pub max_running: usize,
    /// Admitted requests that may wait for a running slot. Beyond `max_running +
    /// max_waiting` requests in the engine, [`crate::EngineHandle::submit`] answers
    /// [`crate::QueueFull`]; the last sixteenth of those places is shared between tenants
    /// so that no one tenant can take them all (`crate::slot`).
    pub max_waiting: usize,
    /// Reuse the K/V of earlier prompts within an isolation domain.
    pub prefix_cache: bool,
    /// Token sequences the operator declares public: their pages may be shared across
    /// domains. Everything else is shared only within one domain.
    pub public_prefixes: Vec<Vec<u32>>,
    /// Exact speculative decoding (`crate::speculation`).
    pub speculation: crate::SpeculationConfig,
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
            max_waiting: 256,
            prefix_cache: true,
            public_prefixes: Vec::new(),
            speculation: Default::default(),
        }
    }
}
