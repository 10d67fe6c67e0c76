//! `kvwarden serve`: the monolithic OpenAI API, or one side (`--role prefill|decode`) of
//! the disaggregated mode.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use engine::EngineConfig;

use crate::{open_model, DEFAULT_MODEL};

#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub(crate) edge: crate::edge::EdgeArgs,
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub(crate) model: PathBuf,
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
    /// FAULT-INJECTION BUILD ONLY: re-enact a known bug, to test `kvwarden audit`.
    #[cfg(feature = "fault-injection")]
    #[arg(long, value_parser = ["incident"])]
    pub(crate) inject_fault: Option<String>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum KvDtypeArg {
    F16,
    F32,
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

pub fn serve(#[allow(unused_mut)] mut args: ServeArgs) -> Result<()> {
    #[cfg(feature = "fault-injection")]
    crate::fault::apply(&mut args);
    let auth = args.edge.auth()?;
    let file = open_model(&args.model)?;
    let tok = tokenizer::Tokenizer::from_gguf(&file)?;
    let template = args.edge.chat_template(&tok)?;
    let public_prefixes = match &args.public_prefixes {
        None => Vec::new(),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let texts: Vec<String> = serde_json::from_str(&text)
                .with_context(|| format!("{}: expected a JSON list of strings", path.display()))?;
            texts
                .iter()
                .map(|t| tok.encode(t))
                .filter(|t| !t.is_empty())
                .collect()
        }
    };
    let model = model::Model::load(&file)?;
    drop(file);
    let kv_dtype = match args.kv_dtype {
        KvDtypeArg::F16 => kv::KvDtype::F16,
        KvDtypeArg::F32 => kv::KvDtype::F32,
    };
    let layout = model.kv_layout(args.kv_page_tokens.max(1), kv_dtype);
    let pool_tokens = match args.kv_pool_mib {
        None => args.kv_pool_tokens,
        Some(mib) => {
            let pages = (mib << 20) / layout.page_bytes().max(1);
            if pages == 0 {
                bail!(
                    "--kv-pool-mib {mib} holds no page of {} bytes",
                    layout.page_bytes()
                );
            }
            pages * layout.page_tokens
        }
    };
    let role = args.role;
    let engine = engine::start(
        model,
        EngineConfig {
            max_context: args.max_context,
            pool_tokens,
            page_tokens: args.kv_page_tokens,
            kv_dtype,
            scrub: match args.kv_scrub {
                ScrubArg::Zero => kv::ScrubPolicy::Zero,
                ScrubArg::Poison => kv::ScrubPolicy::Poison,
                ScrubArg::None => kv::ScrubPolicy::None,
            },
            max_batch_tokens: args.max_batch_tokens,
            max_running: args.max_running,
            max_waiting: args.max_waiting,
            // A decode node only runs received sequences: nothing to share between them.
            prefix_cache: !args.no_prefix_cache && role != Some(RoleArg::Decode),
            public_prefixes,
        },
    )?;
    if let Some(role) = role {
        let identity = transfer::NodeIdentity {
            role: match role {
                RoleArg::Prefill => transfer::Role::Prefill,
                RoleArg::Decode => transfer::Role::Decode,
            },
            model_checksum: model_checksum(&args.model)?,
            pool_tokens: engine.pool_counts().total * layout.page_tokens,
            page_tokens: layout.page_tokens,
            n_layers: layout.n_layers,
            kv_dim: layout.kv_dim,
            kv_dtype_bytes: layout.dtype.bytes(),
        };
        return crate::node::run(args, engine, identity);
    }
    let model_name = served_model_name(&args.served_model_name, &args.model);
    let mut state = server::AppState::new(
        Arc::new(engine.clone()),
        Arc::new(tok),
        template,
        model_name,
        auth,
        args.edge.max_body_bytes,
    );
    args.edge.configure(&mut state)?;
    let state = Arc::new(state);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let stopper = engine.clone();
    let max_context = engine.max_context();
    runtime.block_on(args.edge.serve(
        state.clone(),
        |addr| {
            format!(
                "listening on http://{addr} (model {:?}, max context {max_context})",
                state.model_name
            )
        },
        move || stopper.shutdown(),
    ))?;
    engine.shutdown();
    Ok(())
}

/// The model id clients must send: the flag, else the file's name without `.gguf`.
pub fn served_model_name(flag: &Option<String>, model: &std::path::Path) -> String {
    flag.clone().unwrap_or_else(|| {
        model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "kvwarden".to_owned())
    })
}

/// xxh3-64 of the whole model file: the identity nodes of one cluster must share.
pub fn model_checksum(path: &std::path::Path) -> Result<u64> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(xxhash_rust::xxh3::xxh3_64(&bytes))
}
