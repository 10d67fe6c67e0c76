//! The public OpenAI API's listener, shared by `serve` and `router`: authentication, body
//! and connection limits, and where `/metrics` is served.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::shutdown_signal;

#[derive(clap::Args)]
pub struct EdgeArgs {
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// 0 picks a free port (the address is printed when ready).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// File of `KEY TENANT [WEIGHT]` lines: requests must carry `Authorization: Bearer KEY`,
    /// and each tenant is its own isolation domain. WEIGHT (1 to 100, default 1) is the
    /// tenant's share of the engine when tenants compete for it. Without the file: one
    /// tenant, no authentication.
    #[arg(long)]
    pub api_keys: Option<PathBuf>,
    /// File of `ADAPTER TENANT [TENANT ...]` lines: only the tenants listed may use each
    /// LoRA adapter (an adapter no line lists is usable by nobody). Without it, every
    /// tenant may use every adapter. Without --api-keys, the one tenant is `default`.
    #[arg(long)]
    pub lora_access: Option<PathBuf>,
    #[arg(long, default_value_t = 4 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Open connections at most; one more is answered 503 (with Retry-After) and closed.
    /// Must fit under the open-file limit (`ulimit -n`) with room to spare.
    #[arg(long, default_value_t = 256)]
    pub max_connections: usize,
    /// Of --max-connections, the most one client address may hold (an IPv6 client counts
    /// by its /64); one more is answered 503 and closed, so one address cannot take every
    /// place. Default: half of --max-connections. Behind a proxy every client has the
    /// proxy's address: set it to --max-connections there and limit clients in the proxy.
    #[arg(long)]
    pub max_connections_per_address: Option<usize>,
    /// Seconds a connection may take to send a request's headers, counted from when it
    /// opens or its previous response ends (so also the idle limit of keep-alive).
    #[arg(long, default_value_t = 10)]
    pub header_timeout: u64,
    /// Seconds a new connection may take to send its first request's headers (at most
    /// --header-timeout): a connection that opens and sends nothing, or trickles its
    /// headers, gives its place back this soon.
    #[arg(long, default_value_t = 3)]
    pub first_header_timeout: u64,
    /// Seconds a request body may take to arrive (408 beyond).
    #[arg(long, default_value_t = 30)]
    pub body_timeout: u64,
    /// Seconds a response may wait on a client that does not read it before the
    /// connection (and its generation) is dropped.
    #[arg(long, default_value_t = 30)]
    pub send_timeout: u64,
    /// Serve /metrics only here (HOST:PORT, e.g. an address only the operator's scraper
    /// reaches) instead of on the API address, where it needs an API key when
    /// --api-keys is given: its totals describe every tenant's traffic.
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// Requests one tenant (API key's tenant) may have in progress at once; one more is
    /// answered 429 with Retry-After, while other tenants are unaffected. Unlimited if unset.
    #[arg(long)]
    pub tenant_max_requests: Option<usize>,
    /// Tokens (prompt plus max_tokens) one tenant's requests in progress may hold at once;
    /// beyond, 429 with Retry-After. A tenant with nothing in progress is always let in.
    /// Unlimited if unset.
    #[arg(long)]
    pub tenant_max_tokens: Option<usize>,
    /// A Jinja chat template file to use instead of the GGUF's `tokenizer.chat_template`
    /// (for a file that has none, such as Gemma 3 270M; without either, chat requests are
    /// refused).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// The syntax the model calls tools in: hermes (`<tool_call>`, Qwen), llama3, mistral
    /// (`[TOOL_CALLS]`) or generic (kvwarden's own JSON form, taught in a system message).
    /// Unset, it is the chat template's family.
    #[arg(long)]
    pub tool_format: Option<String>,
    /// Where a thinking model's thoughts go in a chat answer (templates that write
    /// `<think>` blocks: Qwen3, QwQ, DeepSeek-R1 distillations): deepseek (llama.cpp's
    /// default) returns them in the message's `reasoning_content`, apart from its content;
    /// none leaves them in the content, tags and all.
    #[arg(long, default_value = "deepseek")]
    pub reasoning_format: String,
}

/// Applies `--lora-access` to the adapters already in the state's catalog; warns about an
/// adapter nobody may use and a tenant no key authenticates.
fn restrict_adapters(path: &std::path::Path, state: &server::AppState) -> Result<()> {
    if state.adapters.is_empty() {
        bail!(
            "--lora-access {}: no LoRA adapter is served (--lora)",
            path.display()
        );
    }
    let access = server::adapters::AccessList::load(path)?;
    let unlisted = state
        .adapters
        .restrict(&access)
        .with_context(|| format!("--lora-access {}", path.display()))?;
    for name in unlisted {
        tracing::warn!(
            "--lora-access {}: no tenant may use adapter {name:?} (no line lists it)",
            path.display()
        );
    }
    for tenant in access.tenants() {
        if !state.auth.has_tenant(tenant) {
            tracing::warn!(
                "--lora-access {}: tenant {tenant:?} has no API key{}",
                path.display(),
                match state.auth {
                    server::Auth::Open => " (without --api-keys the only tenant is \"default\")",
                    server::Auth::Keys(_) => "",
                }
            );
        }
    }
    Ok(())
}

impl EdgeArgs {
    /// The chat template: `--chat-template`'s file if given, else the GGUF's own, if any.
    pub fn chat_template(
        &self,
        tok: &tokenizer::Tokenizer,
    ) -> Result<Option<tokenizer::ChatTemplate>> {
        match &self.chat_template {
            None => Ok(tok.compile_chat_template()?),
            Some(path) => {
                let source = std::fs::read_to_string(path)
                    .with_context(|| format!("reading --chat-template {}", path.display()))?;
                let t = tok
                    .compile_template_source(&source)
                    .with_context(|| format!("--chat-template {}", path.display()))?;
                Ok(Some(t))
            }
        }
    }

    /// Checked before the model loads, so a bad key file fails fast.
    pub fn auth(&self) -> Result<server::Auth> {
        Ok(match &self.api_keys {
            Some(path) => server::Auth::Keys(server::ApiKeys::load(path)?),
            None => server::Auth::Open,
        })
    }

    /// Applies the connection limits to the state; refuses limits the process cannot keep.
    pub fn configure(&self, state: &mut server::AppState) -> Result<()> {
        state.reasoning_format = server::reasoning::ReasoningFormat::from_name(
            &self.reasoning_format,
        )
        .with_context(|| {
            format!(
                "--reasoning-format {:?} is not one of {}",
                self.reasoning_format,
                server::reasoning::ReasoningFormat::NAMES
            )
        })?;
        if let Some(name) = &self.tool_format {
            state.tool_format = server::tools::ToolFormat::from_name(name).with_context(|| {
                format!(
                    "--tool-format {name:?} is not a tool-call syntax ({})",
                    server::tools::ToolFormat::NAMES
                )
            })?;
        }
        if self.max_connections == 0
            || self.header_timeout == 0
            || self.first_header_timeout == 0
            || self.body_timeout == 0
        {
            bail!("--max-connections, --header-timeout, --first-header-timeout and --body-timeout must be positive");
        }
        // Past the descriptor limit, accept fails and even /health hangs: the cap must keep
        // clear of it (listeners, the runtime and the model file need a few too).
        if let Some(limit) = server::conn::open_files_limit() {
            let needed = self.max_connections as u64 + server::conn::RESERVED_DESCRIPTORS;
            if needed > limit {
                bail!(
                    "--max-connections {} needs about {needed} open files, but the limit is {limit}: lower --max-connections or raise `ulimit -n`",
                    self.max_connections
                );
            }
        }
        if self.tenant_max_requests == Some(0) || self.tenant_max_tokens == Some(0) {
            bail!("--tenant-max-requests and --tenant-max-tokens must be positive");
        }
        state.tenants = Arc::new(server::tenants::TenantUsage::new(
            server::tenants::TenantLimits {
                max_requests: self.tenant_max_requests,
                max_tokens: self.tenant_max_tokens,
            },
        ));
        state.body_timeout = std::time::Duration::from_secs(self.body_timeout);
        let max_per_address = self
            .max_connections_per_address
            .unwrap_or(self.max_connections / 2)
            .max(1);
        if max_per_address > self.max_connections {
            bail!(
                "--max-connections-per-address {max_per_address} is more than --max-connections {}",
                self.max_connections
            );
        }
        state.connection_limits = server::ConnectionLimits {
            max_connections: self.max_connections,
            max_per_address,
            header_timeout: std::time::Duration::from_secs(self.header_timeout),
            first_header_timeout: std::time::Duration::from_secs(
                self.first_header_timeout.min(self.header_timeout),
            ),
            send_timeout: std::time::Duration::from_secs(self.send_timeout.max(1)),
            ..server::ConnectionLimits::default()
        };
        if self.metrics_listen.is_some() {
            state.metrics_access = server::MetricsAccess::OwnListener;
        }
        if let Some(path) = &self.lora_access {
            restrict_adapters(path, state)?;
        }
        Ok(())
    }

    /// Serves the API until SIGINT/SIGTERM; `on_shutdown` runs first (it ends open streams
    /// with an error event, so the graceful shutdown does not wait on generations).
    pub async fn serve(
        &self,
        state: Arc<server::AppState>,
        banner: impl FnOnce(std::net::SocketAddr) -> String,
        on_shutdown: impl FnOnce() + Send + 'static,
    ) -> Result<()> {
        let listener = tokio::net::TcpListener::bind((self.host.as_str(), self.port))
            .await
            .with_context(|| format!("binding {}:{}", self.host, self.port))?;
        eprintln!("kvwarden: {}", banner(listener.local_addr()?));
        let (stopping, stopped) = tokio::sync::watch::channel(false);
        let metrics = match &self.metrics_listen {
            None => None,
            Some(at) => {
                let listener = tokio::net::TcpListener::bind(at.as_str())
                    .await
                    .with_context(|| format!("binding --metrics-listen {at}"))?;
                eprintln!(
                    "kvwarden: metrics on http://{}/metrics",
                    listener.local_addr()?
                );
                let mut stopped = stopped.clone();
                let shutdown = async move {
                    let _ = stopped.changed().await;
                };
                Some(tokio::spawn(server::serve_metrics(
                    listener,
                    state.clone(),
                    shutdown,
                )))
            }
        };
        let on_signal = async move {
            shutdown_signal().await;
            eprintln!("kvwarden: shutting down");
            on_shutdown();
            let _ = stopping.send(true);
        };
        server::serve(listener, state, on_signal)
            .await
            .context("serving")?;
        if let Some(metrics) = metrics {
            metrics
                .await
                .context("metrics listener")?
                .context("serving metrics")?;
        }
        Ok(())
    }
}
