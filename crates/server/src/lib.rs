//! The OpenAI-compatible HTTP API over the engine.
//!
//! Connections pass the connection layer first ([`conn`]: a cap on open connections, header,
//! body and send timeouts). Requests then go through one pipeline: authenticate (the tenant
//! decides the isolation domain), read the JSON body under a size limit and a deadline,
//! decode, validate ([`validation`]: every check that needs no model work), build prompt
//! tokens on a bounded pool ([`prep`]), then the engine's admission and its bounded queue. Anything refused on the way is a 4xx in OpenAI's error
//! shape and never reaches the engine; failures after admission are 5xx responses or one
//! SSE error event, never a 200.

// Memory safety here rests on the compiler alone: the only unsafe code in the workspace is
// the SIMD kernels of the `model` crate and `gguf`'s mapping of the model file, each with
// its own safety argument and test.
#![forbid(unsafe_code)]

pub mod adapters;
pub mod admin;
pub mod auth;
pub mod backend;
pub mod body;
pub mod chat_prompt;
pub mod conn;
pub mod error;
pub mod format;
pub mod generation;
pub mod metrics;
pub mod prep;
pub mod reasoning;
pub mod request;
mod routes;
pub mod stop;
pub mod structured;
pub mod tenants;
mod tokenize;
pub mod tools;
pub mod trace;
pub mod validation;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokenizer::{ChatTemplate, Tokenizer};

pub use auth::{ApiKeys, Auth, KeysError};
pub use backend::{Backend, Submission, SubmitError};
pub use conn::ConnectionLimits;
pub use error::ApiError;
pub use routes::{metrics_router, router};

/// Where `/metrics` is served. Its totals describe every tenant's traffic, so the operator
/// decides who may read them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MetricsAccess {
    /// On the API listener, behind the API keys like every other endpoint: any tenant's
    /// key reads the totals (open when no key file is configured: one tenant).
    #[default]
    ApiKeys,
    /// Only on a listener of its own ([`serve_metrics`]), e.g. an address that only the
    /// operator's scraper can reach; the API listener answers 404.
    OwnListener,
}

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
    /// The longest a request body may take to arrive (408 beyond).
    pub body_timeout: Duration,
    /// Connection cap and timeouts of the HTTP layer ([`conn`]).
    pub connection_limits: ConnectionLimits,
    pub metrics_access: MetricsAccess,
    /// Keys the hash that turns engine request numbers into response ids, so an id tells a
    /// tenant nothing about how many requests others sent.
    id_keys: std::collections::hash_map::RandomState,
    /// The bounded pool that prepares prompts (templates, tokenization).
    pub prompt_workers: prep::PromptWorkers,
    /// Per-tenant limits on requests and tokens in flight ([`tenants`]); unlimited unless
    /// configured.
    pub tenants: Arc<tenants::TenantUsage>,
    /// The vocabulary's most bytes per token, by which a text that cannot fit is refused
    /// before it is tokenized (`Tokenizer::max_bytes_per_token`).
    pub max_bytes_per_token: Option<usize>,
    /// Compiles structured outputs' constraints: the model's vocabulary only, shared by
    /// every request (each compiles its own parser from it).
    pub vocabulary: Arc<constraint::Vocabulary>,
    /// The call syntax tool calling expects: the chat template's family, or the
    /// operator's choice (`--tool-format`).
    pub tool_format: tools::ToolFormat,
    /// Whether a thinking model's thoughts go to `reasoning_content` (`--reasoning-format`).
    pub reasoning_format: reasoning::ReasoningFormat,
    /// The LoRA adapters requests may select, and who may use each (none unless
    /// configured).
    pub adapters: Arc<adapters::Catalog>,
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
        let vocabulary = Arc::new(constraint::Vocabulary::new(
            tokenizer.clone(),
            backend.admission().vocab_size(),
            tokenizer.eos_id(),
        ));
        let tool_format = template.as_ref().map_or(tools::ToolFormat::Generic, |t| {
            tools::ToolFormat::detect(t.source())
        });
        Self {
            adapters: Arc::new(adapters::Catalog::new(
                &model_name,
                Arc::new(engine::Adapters::new()),
            )),
            tool_format,
            reasoning_format: reasoning::ReasoningFormat::default(),
            vocabulary,
            backend,
            max_bytes_per_token: tokenizer.max_bytes_per_token(),
            tokenizer,
            template: template.map(Arc::new),
            model_name,
            auth,
            max_body_bytes,
            metrics: Arc::default(),
            id_keys: std::collections::hash_map::RandomState::new(),
            prompt_workers: prep::PromptWorkers::per_core(),
            tenants: Arc::default(),
            body_timeout: Duration::from_secs(30),
            connection_limits: ConnectionLimits::default(),
            metrics_access: MetricsAccess::default(),
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

/// Serves the API until `shutdown` resolves, then stops accepting connections and waits for
/// the open ones to finish, under the connection limits of `state` ([`conn`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = state.connection_limits.clone();
    conn::serve_router(listener, router(state), limits, shutdown).await
}

/// Serves `/metrics` alone (for [`MetricsAccess::OwnListener`]), under the same limits.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = state.connection_limits.clone();
    conn::serve_router(listener, metrics_router(state), limits, shutdown).await
}
