//! `kvwarden router`: the OpenAI API of `kvwarden serve`, in front of prefill and decode
//! nodes.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::serve::TlsArgs;
use crate::{open_model, shutdown_signal, DEFAULT_MODEL};

#[derive(clap::Args)]
pub struct RouterArgs {
    /// The GGUF file the nodes serve: the router tokenizes and renders chat templates with
    /// it, and refuses nodes that loaded another file.
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: PathBuf,
    /// Internal address (host:port) of a prefill node; repeat for several.
    #[arg(long = "prefill", required = true, num_args = 1..)]
    prefill: Vec<String>,
    /// Internal address (host:port) of a decode node; repeat for several.
    #[arg(long = "decode", required = true, num_args = 1..)]
    decode: Vec<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (the address is printed when ready).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    #[arg(long)]
    served_model_name: Option<String>,
    /// Advertised context (default: the smallest any node holds). Refused at start when a
    /// node cannot hold it.
    #[arg(long)]
    max_context: Option<usize>,
    /// File of `KEY TENANT` lines, as for `kvwarden serve`.
    #[arg(long)]
    api_keys: Option<PathBuf>,
    #[arg(long, default_value_t = 4 * 1024 * 1024)]
    max_body_bytes: usize,
    /// How long one step of the handoff may take (reservation, K/V push, next token).
    #[arg(long, default_value_t = 60)]
    handoff_timeout_secs: u64,
    #[command(flatten)]
    tls: TlsArgs,
}

pub fn run(args: RouterArgs) -> Result<()> {
    let auth = match &args.api_keys {
        Some(path) => server::Auth::Keys(server::ApiKeys::load(path)?),
        None => server::Auth::Open,
    };
    let tls = args.tls.load()?;
    let file = open_model(&args.model)?;
    let tok = tokenizer::Tokenizer::from_gguf(&file)?;
    let template = tok.compile_chat_template()?;
    let vocab_size = model::LlamaConfig::from_gguf(&file)?.vocab_size;
    drop(file);
    let model_checksum = crate::serve::model_checksum(&args.model)?;
    let model_name = args.served_model_name.clone().unwrap_or_else(|| {
        args.model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "kvwarden".to_owned())
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let cluster = router::Cluster::connect(
            router::ClusterConfig {
                prefill: args.prefill.clone(),
                decode: args.decode.clone(),
                model_checksum,
                vocab_size,
                max_context: args.max_context,
                deadlines: transfer::Deadlines {
                    handoff: Duration::from_secs(args.handoff_timeout_secs.max(1)),
                    ..transfer::Deadlines::default()
                },
            },
            &tls,
        )
        .await
        .context("the router refuses to start")?;
        let max_context = server::Backend::admission(cluster.as_ref()).max_context();
        let state = Arc::new(server::AppState::new(
            cluster,
            Arc::new(tok),
            template,
            model_name,
            auth,
            args.max_body_bytes,
        ));
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("binding {}:{}", args.host, args.port))?;
        let addr = listener.local_addr()?;
        eprintln!(
            "kvwarden: router listening on http://{addr} (model {:?}, max context {max_context}, {} prefill and {} decode nodes)",
            state.model_name,
            args.prefill.len(),
            args.decode.len()
        );
        server::serve(listener, state, shutdown_signal())
            .await
            .context("serving")
    })
}
