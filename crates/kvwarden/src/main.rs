//! The `kvwarden` command line.

// Memory safety here rests on the compiler alone: the only unsafe code in the workspace is
// the SIMD kernels of the `model` crate and `gguf`'s mapping of the model file, each with
// its own safety argument and test.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use engine::{EngineConfig, Event, GenerateRequest, IsolationDomain, SamplingParams};

mod adapters;
mod edge;
#[cfg(feature = "fault-injection")]
mod fault;
mod node;
mod router_cmd;
mod serve;
mod serve_args;
mod telemetry;

use serve_args::ServeArgs;

pub(crate) const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

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
    /// Write a synthetic LoRA adapter (llama.cpp's GGUF adapter format) for a base model's
    /// architecture and shapes, with deterministic random weights.
    SynthLora(SynthLoraArgs),
    /// Serve the OpenAI-compatible HTTP API, or one role of the disaggregated mode.
    Serve(ServeArgs),
    /// Serve the OpenAI-compatible HTTP API in front of prefill and decode nodes.
    Router(router_cmd::RouterArgs),
    /// Audit any OpenAI-compatible server by the content of its answers, or replay the
    /// incident (--scenario incident).
    Audit(audit::AuditArgs),
    /// Teacher-forced evaluation: perplexity, and KL divergence and top-1 agreement against
    /// a reference file of llama.cpp's log-probabilities (llama-perplexity's
    /// --kl-divergence-base format).
    Eval(eval::EvalArgs),
    /// Benchmarks: `bench serve` loads any OpenAI-compatible server and reports latency and
    /// throughput.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Write a throwaway cluster CA and one certificate per name (router and nodes).
    Certs {
        /// Directory for ca.pem and NAME.pem / NAME.key.
        #[arg(long)]
        out: PathBuf,
        /// One identity per name.
        #[arg(long = "name", required = true, num_args = 1..)]
        names: Vec<String>,
    },
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
    /// Weight type of the layer matrices, any the model loads, by its ggml name in lower case
    /// (f32, f16, q8_0, q4_k, ...; an unknown name lists them all). The k-quants need dim
    /// and ffn multiples of 256.
    #[arg(long, default_value = "q8_0")]
    weight_type: String,
    /// Architecture: llama, llama3 (llama with Llama 3's RoPE factors and BOS), qwen2, qwen3,
    /// gemma3 (with a sliding window of 8 positions on every second layer).
    #[arg(long, default_value = "llama")]
    arch: String,
    #[arg(short = 'o', long)]
    output: PathBuf,
}

#[derive(clap::Args)]
struct SynthLoraArgs {
    /// The base model the adapter is for (only its metadata is read).
    #[arg(long, default_value = DEFAULT_MODEL)]
    base: PathBuf,
    #[arg(short = 'o', long)]
    out: PathBuf,
    #[arg(long, default_value_t = model::lora::synth::DEFAULT_RANK)]
    rank: usize,
    /// The factor applied is scale x alpha / rank (the scale alone when alpha is 0).
    #[arg(long, default_value_t = model::lora::synth::DEFAULT_ALPHA)]
    alpha: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Tensor type: f32, f16, bf16 or q8_0 (q8_0 needs a rank that is a multiple of 32).
    #[arg(long = "type", default_value = "f32")]
    tensor_type: String,
    /// The weights adapted, of q,k,v,o,gate,up,down,output (output only where the base model
    /// has an output.weight of its own).
    #[arg(long, default_value = "q,k,v,o,gate,up,down")]
    targets: String,
    /// Scale of B's values, U(-1, 1) x magnitude / sqrt(rank) (A's are U(-1, 1) / sqrt(n_in)).
    #[arg(long, default_value_t = model::lora::synth::DEFAULT_MAGNITUDE)]
    magnitude: f32,
}

fn main() {
    let cli = Cli::parse();
    let otlp = match &cli.command {
        Command::Serve(args) => Some((&args.otlp, args.service_name())),
        Command::Router(args) => Some((&args.otlp, "kvwarden-router")),
        _ => None,
    };
    let telemetry = match telemetry::init(otlp) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    #[cfg(feature = "fault-injection")]
    eprintln!("{}", fault::WARNING);
    let result = run(cli);
    drop(telemetry);
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    // A kernel path the CPU cannot run, or a misspelt one, is refused before any work.
    model::kernels::check_cpu_request().map_err(anyhow::Error::msg)?;
    if let Some(n) = cli.threads {
        // The model builds its compute pool from this, like rayon's own default.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    match cli.command {
        Command::Tokenize { model, text } => {
            let file = open_model(&model, gguf::Load::Map)?;
            let tok = tokenizer::Tokenizer::from_gguf(&file)?;
            println!("{}", serde_json::json!({ "tokens": tok.encode(&text) }));
            Ok(())
        }
        Command::Generate(args) => generate(args),
        Command::SynthModel(args) => synth(args),
        Command::SynthLora(args) => synth_lora(args),
        Command::Serve(args) => serve::serve(args),
        Command::Router(args) => router_cmd::run(args),
        Command::Audit(args) => Ok(audit::run_cli(args)?),
        Command::Bench(cmd) => Ok(bench::run_cli(cmd)?),
        Command::Eval(args) => Ok(eval::run_cli(args)?),
        Command::Certs { out, names } => {
            for path in transfer::certs::write_cluster(&out, &names)? {
                eprintln!("wrote {}", path.display());
            }
            Ok(())
        }
    }
}

fn open_model(path: &PathBuf, load: gguf::Load) -> Result<gguf::GgufFile> {
    if !path.exists() {
        bail!(
            "model file {} not found (the default model is fetched by scripts/fetch-model.sh)",
            path.display()
        );
    }
    gguf::GgufFile::open_with(path, load).with_context(|| format!("loading {}", path.display()))
}

fn generate(args: GenerateArgs) -> Result<()> {
    let file = open_model(&args.model, gguf::Load::Map)?;
    let tok = tokenizer::Tokenizer::from_gguf(&file)?;
    let model = model::Model::load(&file)?;
    drop(file);
    let prompt = match (&args.prompt, args.prompt_tokens) {
        (_, Some(ids)) => ids,
        (Some(text), None) => tok.with_bos(tok.encode(text)),
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
        adapter: None,
        weight: 1,
        domain: IsolationDomain::tenant("cli"),
        prompt,
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            seed: args.seed,
            ..Default::default()
        },
        ignore_eos: false,
        logprobs: None,
        constraint: None,
    };
    let admitted = engine.admission().admit(request)?;
    let mut handle = engine.submit(admitted)?;
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
            Event::Prefilled(_) => bail!("the engine answered a prefill-only result"),
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
    let weight_type = model::quant::table::by_name(&args.weight_type).with_context(|| {
        format!(
            "unknown weight type {:?} ({})",
            args.weight_type,
            model::quant::table::names()
        )
    })?;
    let arch = model::synth::SynthArch::from_name(&args.arch).with_context(|| {
        format!(
            "unknown architecture {:?} ({})",
            args.arch,
            model::synth::SynthArch::NAMES
        )
    })?;
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
    let writer = spec.build_arch(arch).map_err(anyhow::Error::msg)?;
    writer
        .write_to(&args.output)
        .with_context(|| format!("writing {}", args.output.display()))?;
    eprintln!("wrote {}", args.output.display());
    Ok(())
}

fn synth_lora(args: SynthLoraArgs) -> Result<()> {
    use model::lora::synth::{tensor_type_by_name, write_synthetic_lora, LoraSpec};
    let tensor_type = tensor_type_by_name(&args.tensor_type).with_context(|| {
        format!(
            "unknown adapter tensor type {:?} (f32, f16, bf16, q8_0)",
            args.tensor_type
        )
    })?;
    let mut spec = LoraSpec {
        rank: args.rank,
        alpha: args.alpha,
        seed: args.seed,
        tensor_type,
        magnitude: args.magnitude,
        ..LoraSpec::default()
    };
    spec.set_targets(&args.targets)?;
    write_synthetic_lora(&args.base, &args.out, &spec)
        .with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!("wrote {}", args.out.display());
    Ok(())
}
