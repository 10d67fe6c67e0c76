//! What to audit and how hard: the audit's configuration.

use std::time::Duration;

use crate::report::CheckName;
use oai_client::Rng;

/// What to audit and how hard.
#[derive(Debug, Clone)]
pub struct Config {
    pub endpoint: String,
    pub api_keys: Vec<String>,
    pub model: Option<String>,
    /// Per tenant (in the keys' order), the model it sends instead of `model`.
    pub tenant_models: Vec<String>,
    pub max_context: Option<usize>,
    pub concurrency: usize,
    /// Requests in the concurrent canary mix.
    pub requests: usize,
    /// Sequential "fill the pool, then send an over-length prompt" pairs.
    pub pressure_pairs: usize,
    pub max_tokens: u32,
    /// Synthetic identities when fewer than two API keys are given.
    pub synthetic_tenants: usize,
    pub batch_invariant: bool,
    pub side_channel_tokens: Option<usize>,
    pub side_channel_trials: usize,
    pub checks: Vec<CheckName>,
    pub seed: u64,
    pub timeout: Duration,
    pub progress: bool,
}

impl Config {
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            api_keys: Vec::new(),
            model: None,
            tenant_models: Vec::new(),
            max_context: None,
            concurrency: 4,
            requests: 16,
            pressure_pairs: 2,
            max_tokens: 16,
            synthetic_tenants: 3,
            batch_invariant: false,
            side_channel_tokens: None,
            side_channel_trials: 2,
            checks: CheckName::ALL.to_vec(),
            seed: Rng::random_seed(),
            timeout: Duration::from_secs(600),
            progress: true,
        }
    }
}
