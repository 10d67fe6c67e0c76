//! The `kvwarden` command line.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use engine::{EngineConfig, Event, GenerateRequest, IsolationDomain, SamplingParams};
use gguf::GgmlType;

#[cfg(feature = "fault-injection")]
mod fault;

const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Parser)]
#[command(
    name = "kvwarden",
    version,
    about = "LLM inference server with KV isolation by construction"
)]
struct Cli {
    /// Compute threads (default: all cores).
    #[arg(long, global = true, env = "KVWARDEN_THREADS")]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the token ids of a text.
    Tokenize {
        #[arg(long, default_value = DEFAULT_MODEL)]
        model: PathBuf,
        #[arg(long)]
        text: String,
    },
    /// Generate a completion for one prompt.
    Generate(GenerateArgs),
    /// Write a synthetic llama GGUF model with deterministic random weights.
    SynthModel(SynthArgs),
    /// Serve the OpenAI-compatible HTTP API.
    Serve(ServeArgs),
    /// Audit any OpenAI-compatible server by the content of its answers, or replay the
    /// incident (--scenario incident).
    Audit(audit::AuditArgs),
}

#[derive(clap::Args)]
struct ServeArgs {
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (the address is printed when ready).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model id clients must send (default: the model file's name without .gguf).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Advertised context window (default: the smaller of the model's and the pool's).
    /// Refused at startup when the KV pool cannot hold one request of this length.
    #[arg(long)]
    max_context: Option<usize>,
    /// KV pool size in tokens, allocated at start.
    #[arg(long, default_value_t = 16_384, conflicts_with = "kv_pool_mib")]
    kv_pool_tokens: usize,
    /// KV pool size as a memory budget in MiB instead of tokens (whole pages that fit).
    #[arg(long)]
    kv_pool_mib: Option<usize>,
    #[arg(long, default_value_t = 16)]
    kv_page_tokens: usize,
    #[arg(long, value_enum, default_value_t = KvDtypeArg::F16)]
    kv_dtype: KvDtypeArg,
    /// What a KV page holds after its lease ends.
    #[arg(long, value_enum, default_value_t = ScrubArg::Zero)]
    kv_scrub: ScrubArg,
    /// Tokens per forward pass (decode rows plus prefill chunks).
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
    /// Requests holding KV pages at once; more wait in the queue.
    #[arg(long, default_value_t = 32)]
    max_running: usize,
    /// File of `KEY TENANT` lines: requests must carry `Authorization: Bearer KEY`, and
    /// each tenant is its own isolation domain. Without it: one tenant, no authentication.
    #[arg(long)]
    api_keys: Option<PathBuf>,
    #[arg(long, default_value_t = 4 * 1024 * 1024)]
    max_body_bytes: usize,
    /// Do not reuse prompt K/V between requests (by default reuse stays within a tenant).
    #[arg(long)]
    no_prefix_cache: bool,
    /// JSON file with a list of prompt texts (e.g. a common system prompt, rendered as the
    /// model sees it) that the operator declares public: their cached pages may be shared
    /// across tenants. Everything else is shared only within one tenant.
    #[arg(long)]
    public_prefixes: Option<PathBuf>,
    /// FAULT-INJECTION BUILD ONLY: re-enact a known bug, to test `kvwarden audit`.
    #[cfg(feature = "fault-injection")]
    #[arg(long, value_parser = ["incident"])]
    inject_fault: Option<String>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum KvDtypeArg {
    F16,
    F32,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ScrubArg {
    Zero,
    Poison,
    None,
}

#[derive(clap::Args)]
struct GenerateArgs {
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: PathBuf,
    /// Prompt text (control tokens such as <|im_start|> are parsed).
    #[arg(
        long,
        conflicts_with = "prompt_tokens",
        required_unless_present = "prompt_tokens"
    )]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    prompt_tokens: Option<Vec<u32>>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print {"tokens":[...],"text":"..."} instead of streaming text.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct SynthArgs {
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[arg(long, default_value_t = 64)]
    dim: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// Feed-forward width (default: 2 x dim).
    #[arg(long)]
    ffn: Option<usize>,
    #[arg(long, default_value_t = 512)]
    vocab: usize,
    #[arg(long, default_value_t = 4096)]
    context: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Weight type of the layer matrices: f32, f16, q4_0, q4_1, q8_0.
    #[arg(long, default_value = "q8_0")]
    weight_type: String,
    #[arg(short = 'o', long)]
    output: PathBuf,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    #[cfg(feature = "fault-injection")]
    eprintln!("{}", fault::WARNING);
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    if let Some(n) = cli.threads {
        // The model builds its compute pool from this, like rayon's own default.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    match cli.command {
        Command::Tokenize { model, text } => {
            let file = open_model(&model)?;
            let tok = tokenizer::Tokenizer::from_gguf(&file)?;
            println!("{}", serde_json::json!({ "tokens": tok.encode(&text) }));
            Ok(())
        }
        Command::Generate(args) => generate(args),
        Command::SynthModel(args) => synth(args),
        Command::Serve(args) => serve(args),
        Command::Audit(args) => Ok(audit::run_cli(args)?),
    }
}

fn open_model(path: &PathBuf) -> Result<gguf::GgufFile> {
    if !path.exists() {
        bail!(
            "model file {} not found (the default model is fetched by scripts/fetch-model.sh)",
            path.display()
        );
    }
    gguf::GgufFile::open(path).with_context(|| format!("loading {}", path.display()))
}

fn generate(args: GenerateArgs) -> Result<()> {
    let file = open_model(&args.model)?;
    let tok = tokenizer::Tokenizer::from_gguf(&file)?;
    let model = model::Model::load(&file)?;
    drop(file);
    let prompt = match (&args.prompt, args.prompt_tokens) {
        (_, Some(ids)) => ids,
        (Some(text), None) => tok.encode(text),
        (None, None) => bail!("give --prompt or --prompt-tokens"),
    };
    let context = model.config.context_length;
    let needed = prompt.len() + args.max_tokens;
    let engine = engine::start(
        model,
        EngineConfig {
            pool_tokens: needed.clamp(16, context),
            max_running: 1,
            ..EngineConfig::default()
        },
    )?;
    let request = GenerateRequest {
        domain: IsolationDomain::tenant("cli"),
        prompt,
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            seed: args.seed,
        },
        stop_tokens: Vec::new(),
        ignore_eos: false,
        logprobs: None,
    };
    let admitted = engine.admission().admit(request)?;
    let mut handle = engine.submit(admitted);
    let mut tokens = Vec::new();
    let mut decoder = tokenizer::IncrementalDecoder::new();
    let mut text = String::new();
    use std::io::Write;
    let mut stdout = std::io::stdout();
    while let Some(ev) = handle.events.blocking_recv() {
        match ev {
            Event::Token(t) => {
                tokens.push(t.id);
                let piece = decoder.push(&tok, t.id)?;
                if !args.json {
                    write!(stdout, "{piece}")?;
                    stdout.flush()?;
                }
                text.push_str(&piece);
            }
            Event::Finished { .. } => break,
            Event::Failed(e) => bail!("generation failed: {e}"),
        }
    }
    text.push_str(&decoder.finish());
    if args.json {
        println!("{}", serde_json::json!({ "tokens": tokens, "text": text }));
    } else {
        println!();
    }
    engine.shutdown();
    Ok(())
}

fn serve(#[allow(unused_mut)] mut args: ServeArgs) -> Result<()> {
    #[cfg(feature = "fault-injection")]
    fault::apply(&mut args);
    // Checked before the model loads, so a bad key file fails fast.
    let auth = match &args.api_keys {
        Some(path) => server::Auth::Keys(server::ApiKeys::load(path)?),
        None => server::Auth::Open,
    };
    let file = open_model(&args.model)?;
    let tok = tokenizer::Tokenizer::from_gguf(&file)?;
    let template = tok.compile_chat_template()?;
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
    let pool_tokens = match args.kv_pool_mib {
        None => args.kv_pool_tokens,
        Some(mib) => {
            let layout = model.kv_layout(args.kv_page_tokens.max(1), kv_dtype);
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
            prefix_cache: !args.no_prefix_cache,
            public_prefixes,
        },
    )?;
    let model_name = args.served_model_name.clone().unwrap_or_else(|| {
        args.model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "kvwarden".to_owned())
    });
    let state = std::sync::Arc::new(server::AppState::new(
        engine,
        std::sync::Arc::new(tok),
        template,
        model_name,
        auth,
        args.max_body_bytes,
    ));

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let engine = state.engine.clone();
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("binding {}:{}", args.host, args.port))?;
        let addr = listener.local_addr()?;
        eprintln!(
            "kvwarden: listening on http://{addr} (model {:?}, max context {})",
            state.model_name,
            state.engine.max_context()
        );
        let on_signal = {
            let engine = state.engine.clone();
            async move {
                shutdown_signal().await;
                eprintln!("kvwarden: shutting down");
                // Ends every open stream with an error event so graceful shutdown does
                // not wait on generations.
                engine.shutdown();
            }
        };
        server::serve(listener, state, on_signal)
            .await
            .context("serving")
    })?;
    engine.shutdown();
    Ok(())
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn synth(args: SynthArgs) -> Result<()> {
    let weight_type = match args.weight_type.as_str() {
        "f32" => GgmlType::F32,
        "f16" => GgmlType::F16,
        "q4_0" => GgmlType::Q4_0,
        "q4_1" => GgmlType::Q4_1,
        "q8_0" => GgmlType::Q8_0,
        other => bail!("unknown weight type {other:?} (f32, f16, q4_0, q4_1, q8_0)"),
    };
    let spec = model::synth::SynthSpec {
        layers: args.layers,
        dim: args.dim,
        heads: args.heads,
        kv_heads: args.kv_heads,
        ffn_dim: args.ffn.unwrap_or(args.dim * 2),
        vocab: args.vocab,
        context: args.context,
        seed: args.seed,
        weight_type,
    };
    let writer = spec.build().map_err(anyhow::Error::msg)?;
    writer
        .write_to(&args.output)
        .with_context(|| format!("writing {}", args.output.display()))?;
    eprintln!("wrote {}", args.output.display());
    Ok(())
}
