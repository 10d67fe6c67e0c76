//! `kvwarden router`: the OpenAI API of `kvwarden serve`, in front of prefill and decode
//! nodes.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::serve_args::TlsArgs;
use crate::{open_model, DEFAULT_MODEL};

#[derive(clap::Args)]
pub struct RouterArgs {
    /// The GGUF file the nodes serve: the router tokenizes and renders chat templates with
    /// it, and refuses nodes that loaded another file.
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: PathBuf,
    /// Internal address (host:port) of a prefill node, or `dns:NAME:PORT` for a node at
    /// PORT on every address NAME resolves to (a headless Service), looked up again every
    /// --dns-interval: new nodes join once they pass the start-up checks, vanished ones are
    /// drained. Repeat for several.
    #[arg(long = "prefill", required = true, num_args = 1.., value_parser = node_source)]
    prefill: Vec<router::NodeSource>,
    /// A decode node, as for --prefill.
    #[arg(long = "decode", required = true, num_args = 1.., value_parser = node_source)]
    decode: Vec<router::NodeSource>,
    /// The DNS server (IP:PORT) that `dns:` names are asked of; by default the system's
    /// (/etc/resolv.conf).
    #[arg(long)]
    dns_server: Option<std::net::SocketAddr>,
    /// Seconds between look-ups of the `dns:` names.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    dns_interval: u64,
    #[command(flatten)]
    edge: crate::edge::EdgeArgs,
    #[arg(long)]
    served_model_name: Option<String>,
    /// Advertised context (default: the smallest any node holds). Refused at start when a
    /// node cannot hold it.
    #[arg(long)]
    max_context: Option<usize>,
    /// How long one step of the handoff may take (reservation, K/V push, next token).
    #[arg(long, default_value_t = 60)]
    handoff_timeout_secs: u64,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    pub(crate) otlp: crate::telemetry::OtlpArgs,
}

pub fn run(args: RouterArgs) -> Result<()> {
    let auth = args.edge.auth()?;
    let tls = args.tls.load()?;
    // The router reads the vocabulary and the shape, never the weights.
    let file = open_model(&args.model, gguf::Load::Map)?;
    let tok = tokenizer::Tokenizer::from_gguf(&file)?;
    let template = args.edge.chat_template(&tok)?;
    let vocab_size = model::LlamaConfig::from_gguf(&file)?.vocab_size;
    drop(file);
    let model_checksum = crate::serve::model_checksum(&args.model)?;
    let model_name = crate::serve::served_model_name(&args.served_model_name, &args.model);
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
                discovery: router::Discovery {
                    nameserver: args.dns_server,
                    interval: Duration::from_secs(args.dns_interval),
                },
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
        // The adapters every node holds (the start checks made sure they agree), offered
        // by name in name order; `--lora-access` then restricts them (`configure`).
        let catalog = server::adapters::Catalog::new(&model_name, cluster.clone());
        for adapter in cluster.adapters() {
            catalog
                .add(&adapter.name, adapter.scale, None)
                .with_context(|| format!("the nodes' LoRA adapter {:?}", adapter.name))?;
        }
        let mut state = server::AppState::new(
            cluster,
            Arc::new(tok),
            template,
            model_name,
            auth,
            args.edge.max_body_bytes,
        );
        state.adapters = Arc::new(catalog);
        args.edge.configure(&mut state)?;
        let state = Arc::new(state);
        let (prefill, decode) = (args.prefill.len(), args.decode.len());
        args.edge
            .serve(
                state.clone(),
                |addr| {
                    format!(
                        "router listening on http://{addr} (model {:?}, max context {max_context}, {prefill} prefill and {decode} decode node sources)",
                        state.model_name
                    )
                },
                || {},
            )
            .await
    })
}

fn node_source(arg: &str) -> Result<router::NodeSource, String> {
    router::NodeSource::parse(arg)
}
