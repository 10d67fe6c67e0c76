//! `kvwarden audit`: tests any OpenAI-compatible server by the *content* of its answers.
//!
//! The incident this project answers (described at the top of README.md) passed every pre-launch test
//! because the tests checked status codes and speed, never what the answers said. This
//! crate is the test that would have caught it, usable against kvwarden, vLLM, SGLang or
//! llama.cpp's `llama-server`. It is black-box by construction: it talks HTTP and depends
//! on no engine, KV or model crate.
//!
//! Checks: capacity honesty, cross-tenant canaries, differential content (alone vs
//! batched), status honesty, and the prefix-cache timing side channel. `--scenario incident`
//! replays the incident against kvwarden itself ([`scenario`]).

#![forbid(unsafe_code)]

mod auditor;
mod canary;
mod checks;
mod config;
pub mod deploy;
mod discover;
mod error;
pub mod html;
mod inspect;
mod progress;
mod prompts;
mod record;
pub mod report;
mod run;
pub mod scenario;
mod text;

use std::path::PathBuf;
use std::time::Duration;

pub use config::Config;
pub use error::AuditError;
pub use report::{CheckName, Report};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Replay the incident against kvwarden itself (this executable, on a synthetic model).
    Incident,
}

/// How a scenario deploys kvwarden.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TopologyArg {
    /// `kvwarden router` in front of one prefill and one decode node, as in the incident.
    Disaggregated,
    /// One `kvwarden serve`.
    Monolithic,
}

/// `kvwarden audit` arguments.
#[derive(Debug, clap::Args)]
pub struct AuditArgs {
    /// Base URL of the server under test (http://host:port, with or without /v1).
    #[arg(long, required_unless_present = "scenario")]
    pub endpoint: Option<String>,
    /// An API key; give it several times for several tenants (one tenant per key).
    #[arg(long = "api-key", value_name = "KEY")]
    pub api_keys: Vec<String>,
    /// Model name to send (default: the first of /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// The model the i-th `--api-key`'s tenant sends instead (repeat it in the keys'
    /// order): LoRA adapters of one base model are then audited against each other, the
    /// same key twice with two adapters included.
    #[arg(long = "tenant-model", value_name = "MODEL")]
    pub tenant_models: Vec<String>,
    /// Context window to test (default: /v1/models max_model_len, or llama.cpp's /props).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Requests in flight at once in the canary mix.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Requests in the concurrent canary mix.
    #[arg(long, default_value_t = 16)]
    pub requests: usize,
    /// Sequential pool-fill / over-length pairs (the incident's pattern).
    #[arg(long, default_value_t = 2)]
    pub pressure_pairs: usize,
    /// max_tokens of most requests.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u32,
    /// Synthetic identities to use when fewer than two API keys are given.
    #[arg(long, default_value_t = 3)]
    pub tenants: usize,
    /// The server claims batch invariance (kvwarden does): a greedy answer that changes
    /// between batched and alone is a failure, not a rate.
    #[arg(long)]
    pub batch_invariant: bool,
    /// Prefix length of the side-channel probe (default: min(context / 2, 1024)).
    #[arg(long)]
    pub side_channel_tokens: Option<usize>,
    #[arg(long, default_value_t = 2)]
    pub side_channel_trials: usize,
    /// Checks to run (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub checks: Vec<CheckName>,
    /// Seed for canaries and prompts (default: random), to repeat a run.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_secs: u64,
    /// Write the report as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the report as a self-contained HTML page.
    #[arg(long)]
    pub html: Option<PathBuf>,
    /// No progress bar (it is drawn only on a terminal anyway).
    #[arg(long)]
    pub no_progress: bool,
    /// Run a scenario instead of auditing an endpoint.
    #[arg(long, value_enum, conflicts_with = "endpoint")]
    pub scenario: Option<Scenario>,
    /// How the scenario deploys kvwarden.
    #[arg(long, value_enum, default_value_t = TopologyArg::Disaggregated)]
    pub topology: TopologyArg,
    /// The kvwarden binary a scenario launches (default: this executable).
    #[arg(long)]
    pub kvwarden_bin: Option<PathBuf>,
}

impl AuditArgs {
    pub fn config(&self, endpoint: String) -> Config {
        let mut c = Config::new(endpoint);
        c.api_keys = self.api_keys.clone();
        c.tenant_models = self.tenant_models.clone();
        c.model = self.model.clone();
        c.max_context = self.max_context;
        c.concurrency = self.concurrency;
        c.requests = self.requests;
        c.pressure_pairs = self.pressure_pairs;
        c.max_tokens = self.max_tokens.max(1);
        c.synthetic_tenants = self.tenants;
        c.batch_invariant = self.batch_invariant;
        c.side_channel_tokens = self.side_channel_tokens;
        c.side_channel_trials = self.side_channel_trials;
        if !self.checks.is_empty() {
            c.checks = self.checks.clone();
        }
        if let Some(s) = self.seed {
            c.seed = s;
        }
        c.timeout = Duration::from_secs(self.timeout_secs.max(1));
        c.progress = !self.no_progress;
        c
    }
}

fn write(path: &PathBuf, text: &str) -> Result<(), AuditError> {
    std::fs::write(path, text).map_err(|source| AuditError::Write {
        path: path.clone(),
        source,
    })
}

/// Runs `kvwarden audit`: prints the summary (or the scenario's report) on stdout, writes
/// the JSON and HTML reports, and fails when any check failed.
pub fn run_cli(args: AuditArgs) -> Result<(), AuditError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(AuditError::Runtime)?;
    if let Some(Scenario::Incident) = args.scenario {
        let exe = match &args.kvwarden_bin {
            Some(p) => p.clone(),
            None => std::env::current_exe()
                .map_err(|e| AuditError::Usage(format!("cannot find this executable: {e}")))?,
        };
        let workdir =
            std::env::temp_dir().join(format!("kvwarden-incident-{}", std::process::id()));
        let topology: Box<dyn deploy::Topology> = match args.topology {
            TopologyArg::Monolithic => Box::new(deploy::Monolithic { exe: exe.clone() }),
            TopologyArg::Disaggregated => Box::new(deploy::Disaggregated {
                exe: exe.clone(),
                workdir: workdir.join("cluster"),
            }),
        };
        let mut stdout = std::io::stdout();
        let result = runtime.block_on(scenario::incident(
            topology.as_ref(),
            &exe,
            &workdir,
            &mut stdout,
        ));
        let _ = std::fs::remove_dir_all(&workdir);
        return match result? {
            true => Ok(()),
            false => Err(AuditError::Failed(
                "the incident replay found a failure".into(),
            )),
        };
    }
    let endpoint = args
        .endpoint
        .clone()
        .ok_or_else(|| AuditError::Usage("--endpoint is required".into()))?;
    let report = runtime.block_on(run::run(args.config(endpoint)))?;
    print!("{}", report.summary_text());
    if let Some(p) = &args.json {
        let json = serde_json::to_string_pretty(&report)
            .map_err(|e| AuditError::Usage(format!("cannot serialize the report: {e}")))?;
        write(p, &json)?;
    }
    if let Some(p) = &args.html {
        write(p, &html::render(&report))?;
    }
    if report.passed {
        Ok(())
    } else {
        Err(AuditError::Failed(format!(
            "{} failures, {} leaks",
            report.failures(),
            report.leaks.len()
        )))
    }
}
