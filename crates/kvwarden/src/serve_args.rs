//! `kvwarden serve`'s command line: the flags of the monolithic server and of a node, and the
//! cluster identity a node or router presents. Its own module so that the role-specific
//! parts (`node`, `fault`) read the flags without depending on `serve`, which runs them.

use std::path::PathBuf;

use anyhow::{bail, Result};

use crate::DEFAULT_MODEL;

#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub(crate) edge: crate::edge::EdgeArgs,
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub(crate) model: PathBuf,
    /// Read the model file into memory of this process's own instead of mapping it (by
    /// default the weights kept as stored are used from the mapped file, shared with every
    /// process serving it; replace a served file by renaming a new one over it).
    #[arg(long)]
    pub(crate) no_mmap: bool,
    /// The model id clients must send (default: the model file's name without .gguf).
    #[arg(long)]
    pub(crate) served_model_name: Option<String>,
    /// Advertised context window (default: the smaller of the model's and the pool's).
    /// Refused at startup when the KV pool cannot hold one request of this length.
    #[arg(long)]
    pub(crate) max_context: Option<usize>,
    /// KV pool size in tokens, allocated at start.
    #[arg(long, default_value_t = 16_384, conflicts_with = "kv_pool_mib")]
    pub(crate) kv_pool_tokens: usize,
    /// KV pool size as a memory budget in MiB instead of tokens (whole pages that fit).
    #[arg(long)]
    pub(crate) kv_pool_mib: Option<usize>,
    #[arg(long, default_value_t = 16)]
    pub(crate) kv_page_tokens: usize,
    /// How K/V values are stored. The block formats (q8_0, q4_0) hold more tokens per MiB
    /// and are stored Walsh-Hadamard-rotated, as llama.cpp stores a quantized cache; every
    /// node of a cluster must store the same type.
    #[arg(long, value_enum, default_value_t = KvDtypeArg::F16)]
    pub(crate) kv_dtype: KvDtypeArg,
    /// What a KV page holds after its lease ends.
    #[arg(long, value_enum, default_value_t = ScrubArg::Zero)]
    pub(crate) kv_scrub: ScrubArg,
    /// Tokens per forward pass (decode rows plus prefill chunks).
    #[arg(long, default_value_t = 512)]
    pub(crate) max_batch_tokens: usize,
    /// Requests holding KV pages at once; more wait in the queue.
    #[arg(long, default_value_t = 32)]
    pub(crate) max_running: usize,
    /// Admitted requests that may wait for a running slot; beyond that, requests get 429
    /// with Retry-After.
    #[arg(long, default_value_t = 256)]
    pub(crate) max_waiting: usize,
    /// Do not reuse prompt K/V between requests (by default reuse stays within a tenant).
    #[arg(long)]
    pub(crate) no_prefix_cache: bool,
    /// JSON file with a list of prompt texts (e.g. a common system prompt, rendered as the
    /// model sees it) that the operator declares public: their cached pages may be shared
    /// across tenants. Everything else is shared only within one tenant.
    #[arg(long)]
    pub(crate) public_prefixes: Option<PathBuf>,
    /// Exact speculative decoding (prompt lookup, or `--draft-model`): `auto` drafts while
    /// a step has spare room (at most 4 decode rows, no prompt being computed, nobody
    /// waiting), `on` on every decode row, `off` never. The tokens are the same in every
    /// mode.
    #[arg(long, value_enum, default_value_t = SpeculationArg::Auto)]
    pub(crate) speculation: SpeculationArg,
    /// The most draft tokens one request carries in a step (1 to 12: the lengths whose
    /// verification cost the policy knows).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=12))]
    pub(crate) max_draft_tokens: u16,
    /// A smaller GGUF with this model's vocabulary (refused at start otherwise, naming the
    /// difference) that proposes the drafts instead of prompt lookup. Its K/V has a pool of
    /// its own, as many positions as the model's. A prefill node never decodes and does not
    /// load it.
    #[arg(long)]
    pub(crate) draft_model: Option<PathBuf>,
    /// What one of the draft model's one-token steps costs, in steps of the served model,
    /// as the draft-length policy weighs it (more than 0, at most 10). By default measured
    /// at start: the median of a few one-token steps of each model on this machine.
    #[arg(long, requires = "draft_model", value_parser = draft_cost)]
    pub(crate) draft_cost: Option<f32>,
    /// Run one side of the disaggregated mode instead of the OpenAI API: `--port` is then
    /// the internal API (gRPC over mutual TLS, for `kvwarden router` and other nodes).
    #[arg(long, value_enum, requires_all = ["tls_ca", "tls_cert", "tls_key"])]
    pub(crate) role: Option<RoleArg>,
    #[command(flatten)]
    pub(crate) tls: TlsArgs,
    /// Node roles: plain HTTP `/health` and `/metrics` on this port (0 picks one).
    #[arg(long, requires = "role")]
    pub(crate) metrics_port: Option<u16>,
    /// Node roles: how long a decode node waits for a prompt's K/V after reserving pages,
    /// and a prefill node for the decode node to take it.
    #[arg(long, default_value_t = 60)]
    pub(crate) handoff_timeout_secs: u64,
    /// A LoRA adapter (llama.cpp's GGUF adapter format) for this model, served under NAME:
    /// a request selects it by `"model": NAME` or by llama.cpp's `lora` field (ids in the
    /// order of these flags). SCALE (default 1, not 0) multiplies its update; a request
    /// cannot ask for another. Repeatable. Who may use which: --lora-access.
    #[arg(long = "lora", value_name = "NAME=PATH[,SCALE]", value_parser = crate::adapters::parse_lora_flag)]
    pub(crate) lora: Vec<crate::adapters::LoraFlag>,
    /// The operator API (load, list and unload adapters while serving) on this HOST:PORT, a
    /// listener of its own that tenants' keys do not open (needs --admin-token-file).
    /// Monolithic serve only.
    #[arg(long, requires = "admin_token_file")]
    pub(crate) admin_listen: Option<String>,
    /// File holding the operator API's bearer token (refused if missing or empty).
    #[arg(long, requires = "admin_listen")]
    pub(crate) admin_token_file: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) otlp: crate::telemetry::OtlpArgs,
    /// FAULT-INJECTION BUILD ONLY: re-enact a known bug, to test `kvwarden audit`.
    #[cfg(feature = "fault-injection")]
    #[arg(long, value_parser = ["incident"])]
    pub(crate) inject_fault: Option<String>,
}

impl ServeArgs {
    /// The `service.name` of this process's traces.
    pub(crate) fn service_name(&self) -> &'static str {
        match self.role {
            None => "kvwarden",
            Some(RoleArg::Prefill) => "kvwarden-prefill",
            Some(RoleArg::Decode) => "kvwarden-decode",
        }
    }
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum KvDtypeArg {
    F16,
    F32,
    /// llama.cpp's block_q8_0: 34 bytes for 32 values (1.88x the tokens of f16 per byte).
    #[value(name = "q8_0")]
    Q8_0,
    /// llama.cpp's block_q4_0: 18 bytes for 32 values (3.56x the tokens of f16 per byte).
    #[value(name = "q4_0")]
    Q4_0,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum SpeculationArg {
    Auto,
    On,
    Off,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum ScrubArg {
    Zero,
    Poison,
    None,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RoleArg {
    Prefill,
    Decode,
}

/// The cluster identity of a router or node (see `kvwarden certs`).
#[derive(clap::Args, Clone)]
pub struct TlsArgs {
    /// The cluster CA certificate (PEM): peers must present a certificate it signed.
    #[arg(long)]
    pub tls_ca: Option<PathBuf>,
    /// This process's certificate (PEM), signed by the cluster CA.
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,
    /// This process's private key (PEM).
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
}

impl TlsArgs {
    pub fn load(&self) -> Result<transfer::TlsIdentity> {
        let (Some(ca), Some(cert), Some(key)) = (&self.tls_ca, &self.tls_cert, &self.tls_key)
        else {
            bail!("--tls-ca, --tls-cert and --tls-key are required: internal traffic is mutually authenticated (make them with `kvwarden certs`)");
        };
        Ok(transfer::TlsIdentity::load(&transfer::TlsFiles {
            ca: ca.clone(),
            cert: cert.clone(),
            key: key.clone(),
        })?)
    }
}

fn draft_cost(value: &str) -> Result<f32, String> {
    let cost: f32 = value
        .parse()
        .map_err(|_| format!("{value:?} is not a number"))?;
    if cost > 0.0 && cost <= 10.0 {
        Ok(cost)
    } else {
        Err(format!("{value} is not in (0, 10]"))
    }
}
