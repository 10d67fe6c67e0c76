//! The OpenAI-compatible HTTP API over the engine.
//!
//! Requests go through one pipeline: authenticate (the tenant decides the isolation
//! domain), read the body under a size limit, decode and validate, build prompt tokens,
//! then the engine's admission. Anything refused on the way is a 4xx in OpenAI's error
//! shape and never reaches the engine; failures after admission are 5xx responses or one
//! SSE error event, never a 200.

// Memory safety here rests on the compiler alone: the only unsafe code in the workspace is
// the SIMD kernels of the `model` crate, each with its own safety argument and test.
#![forbid(unsafe_code)]

pub mod auth;
pub mod backend;
pub mod body;
pub mod chat_prompt;
pub mod error;
pub mod format;
pub mod generation;
pub mod metrics;
pub mod request;
mod routes;
pub mod stop;

use std::future::Future;
use std::sync::Arc;

use tokenizer::{ChatTemplate, Tokenizer};

pub use auth::{ApiKeys, Auth, KeysError};
pub use backend::{Backend, Submission, SubmitError};
pub use error::ApiError;
pub use routes::router;

/// Everything the handlers share.
pub struct AppState {
    pub backend: Arc<dyn Backend>,
    pub tokenizer: Arc<Tokenizer>,
    /// `None` when the model has no chat template: chat requests are then refused.
    pub template: Option<Arc<ChatTemplate>>,
    pub model_name: String,
    pub auth: Auth,
    pub max_body_bytes: usize,
    pub metrics: Arc<metrics::ServerMetrics>,
    /// When the server started (the `created` of `/v1/models`).
    pub created: u64,
    /// Keys the hash that turns engine request numbers into response ids, so an id tells a
    /// tenant nothing about how many requests others sent.
    id_keys: std::collections::hash_map::RandomState,
}

impl AppState {
    pub fn new(
        backend: Arc<dyn Backend>,
        tokenizer: Arc<Tokenizer>,
        template: Option<ChatTemplate>,
        model_name: String,
        auth: Auth,
        max_body_bytes: usize,
    ) -> Self {
        Self {
            backend,
            tokenizer,
            template: template.map(Arc::new),
            model_name,
            auth,
            max_body_bytes,
            metrics: Arc::default(),
            id_keys: std::collections::hash_map::RandomState::new(),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        }
    }
}

impl AppState {
    /// An opaque response id for an engine request: a keyed hash (SipHash with a random
    /// per-process key) of its sequence number.
    pub fn response_id(&self, prefix: &str, request: engine::RequestId) -> String {
        use std::hash::BuildHasher;
        format!("{prefix}-{:016x}", self.id_keys.hash_one(request.0))
    }
}

/// Serves until `shutdown` resolves, then stops accepting connections and waits for the
/// open ones to finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}
