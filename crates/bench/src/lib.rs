//! `kvwarden bench serve`: load on any OpenAI-compatible server, timed as a client sees it.
//!
//! Streaming `/v1/completions` with token-id prompts of exact lengths (random ids from a
//! range clear of special tokens, a different prompt per request so no prefix cache helps)
//! or text prompts, at a fixed concurrency (closed loop) or a Poisson request rate (open
//! loop). It reports time to first token, time per output token, inter-token and
//! end-to-end latency (mean, p50, p90, p99), and output and total tokens per second over
//! the wall time. HTTP only: the same numbers for kvwarden, llama.cpp's server or vLLM.
//! `--chat` sends the text prompts to `/v1/chat/completions` instead, and `--tools` makes
//! every request a tool-calling one (tool calls' deltas count as generated output).

#![forbid(unsafe_code)]

mod error;
pub mod report;
mod runner;
pub mod stats;
pub mod workload;

use std::ops::Range;
use std::path::PathBuf;
use std::time::Duration;

use oai_client::{Api, Call, Client};
use serde_json::Value;

pub use error::BenchError;
pub use report::Report;
use runner::Schedule;
use workload::PromptSpec;

#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// Load an OpenAI-compatible server with streaming completions and report latency and
    /// throughput.
    Serve(ServeArgs),
}

/// `kvwarden bench serve` arguments.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Base URL of the server (http://host:port, with or without /v1).
    #[arg(long)]
    pub base_url: String,
    /// Bearer key to send.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Model name to send (default: the first of /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// Spread the requests over these model names (comma-separated), request `i` taking
    /// the `i mod n`-th: a load over several adapters of one base model.
    #[arg(long, value_delimiter = ',', conflicts_with = "model")]
    pub models: Vec<String>,
    /// Token-id prompts of exactly N tokens (the default, 200).
    #[arg(long, conflicts_with = "prompt_words")]
    pub prompt_tokens: Option<usize>,
    /// Text prompts of N random common words instead of token ids.
    #[arg(long, conflicts_with = "repeat_words")]
    pub prompt_words: Option<usize>,
    /// Input-grounded text prompts: a passage of N random common words and the instruction
    /// to repeat it, the kind of task (extraction, edits, quoting) whose answers prompt
    /// lookup drafts well.
    #[arg(long, conflicts_with = "prompt_tokens")]
    pub repeat_words: Option<usize>,
    /// Token ids are drawn from LO..HI (HI exclusive): keep it clear of the vocabulary's
    /// special and control tokens and inside its size. The default suits SmolLM2, Llama and
    /// Qwen vocabularies.
    #[arg(long, default_value = "1000..10000", value_parser = workload::parse_id_range)]
    pub token_id_range: Range<u32>,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// Ask the server to generate past end-of-sequence, so every request gives max_tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 32)]
    pub num_requests: usize,
    /// Requests in flight: a closed loop of C clients, or with --request-rate the most in
    /// flight at once (default 1 without a rate, unlimited with one).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Start requests as a Poisson process of R per second (open loop).
    #[arg(long)]
    pub request_rate: Option<f64>,
    /// Seed of the prompts and arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Seconds one request may take.
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    /// Constrain every answer to the JSON schema in FILE (sent as llama.cpp's and
    /// kvwarden's `json_schema` field), to measure what structured outputs cost. Give it a
    /// schema whose answers run past --max-tokens to keep every answer max_tokens long.
    #[arg(long, value_name = "FILE", conflicts_with = "ignore_eos")]
    pub json_schema: Option<PathBuf>,
    /// Send the prompts as a user message to /v1/chat/completions (text prompts only:
    /// give --prompt-words).
    #[arg(long)]
    pub chat: bool,
    /// Every chat request declares the tools in FILE (a JSON array of OpenAI tool objects)
    /// with --tool-choice, to measure what tool calling costs. With `required` or a named
    /// function, give a function whose arguments run past --max-tokens to keep every
    /// answer max_tokens long.
    #[arg(long, value_name = "FILE", requires = "chat", conflicts_with_all = ["ignore_eos", "json_schema"])]
    pub tools: Option<PathBuf>,
    /// `auto`, `none`, `required`, or the name of one of the tools' functions.
    #[arg(long, default_value = "required", requires = "tools")]
    pub tool_choice: String,
    /// Write the report as JSON to PATH ("-": print it on stdout instead of the table).
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
}

pub fn run_cli(cmd: BenchCommand) -> Result<(), BenchError> {
    match cmd {
        BenchCommand::Serve(args) => {
            // One thread: the load generator should take as little CPU from a server on the
            // same machine as it can.
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(BenchError::Runtime)?;
            rt.block_on(serve(args))
        }
    }
}

fn check(args: &ServeArgs) -> Result<(), BenchError> {
    let bad = |m: &str| Err(BenchError::Usage(m.into()));
    if args.num_requests == 0 {
        return bad("--num-requests must be at least 1");
    }
    if args.max_tokens == 0 {
        return bad("--max-tokens must be at least 1");
    }
    if args.concurrency == Some(0) {
        return bad("--concurrency must be at least 1");
    }
    if args
        .request_rate
        .is_some_and(|r| !(r.is_finite() && r > 0.0))
    {
        return bad("--request-rate must be a positive number");
    }
    if args.prompt_tokens == Some(0) || args.prompt_words == Some(0) || args.repeat_words == Some(0)
    {
        return bad("a prompt must have at least one token or word");
    }
    if args.chat && args.prompt_words.is_none() && args.repeat_words.is_none() {
        return bad("--chat sends text: give --prompt-words or --repeat-words");
    }
    Ok(())
}

/// The body fields a request gets beside its prompt: a schema, or tools and a tool choice.
fn extra_fields(args: &ServeArgs) -> Result<serde_json::Map<String, Value>, BenchError> {
    let read_json = |path: &PathBuf| -> Result<Value, BenchError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| BenchError::Usage(format!("reading {}: {e}", path.display())))?;
        serde_json::from_str(&text)
            .map_err(|e| BenchError::Usage(format!("{}: not JSON: {e}", path.display())))
    };
    let mut extra = serde_json::Map::new();
    if let Some(path) = &args.json_schema {
        extra.insert("json_schema".into(), read_json(path)?);
    }
    if let Some(path) = &args.tools {
        let tools = read_json(path)?;
        let Some(list) = tools.as_array().filter(|l| !l.is_empty()) else {
            return Err(BenchError::Usage(format!(
                "{}: not a non-empty JSON array of tools",
                path.display()
            )));
        };
        let choice = match args.tool_choice.as_str() {
            c @ ("auto" | "none" | "required") => Value::from(c),
            name => {
                let declared = list
                    .iter()
                    .any(|t| t.pointer("/function/name").and_then(Value::as_str) == Some(name));
                if !declared {
                    return Err(BenchError::Usage(format!(
                        "--tool-choice {name}: no such function in {}",
                        path.display()
                    )));
                }
                serde_json::json!({"type": "function", "function": {"name": name}})
            }
        };
        extra.insert("tools".into(), tools);
        extra.insert("tool_choice".into(), choice);
    }
    Ok(extra)
}

async fn serve(args: ServeArgs) -> Result<(), BenchError> {
    check(&args)?;
    let mut client = Client::new(&args.base_url, Duration::from_secs(args.timeout.max(1)))?;
    client.model = match (&args.model, args.models.first()) {
        (Some(m), _) | (None, Some(m)) => m.clone(),
        (None, None) => served_model(&client, args.api_key.as_deref()).await?,
    };
    let spec = match (args.prompt_words, args.repeat_words) {
        (Some(len), _) => PromptSpec::Words { len },
        (None, Some(len)) => PromptSpec::Repeat { len },
        (None, None) => PromptSpec::Tokens {
            len: args.prompt_tokens.unwrap_or(200),
            ids: args.token_id_range.clone(),
        },
    };
    let extra = extra_fields(&args)?;
    let api = if args.chat {
        Api::Chat
    } else {
        Api::Completions
    };
    let calls: Vec<Call> = workload::prompts(&spec, args.num_requests, args.seed)
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| Call {
            api,
            prompt,
            max_tokens: args.max_tokens,
            temperature: args.temperature,
            stream: true,
            logprobs: false,
            ignore_eos: args.ignore_eos,
            cancel_after: None,
            key: args.api_key.clone(),
            extra: match args.models.len() {
                0 => extra.clone(),
                n => {
                    let mut with_model = extra.clone();
                    with_model.insert("model".into(), args.models[i % n].clone().into());
                    with_model
                }
            },
        })
        .collect();
    let schedule = match args.request_rate {
        Some(rate) => Schedule::Open {
            arrivals: workload::poisson_arrivals(args.num_requests, rate, args.seed),
            max_in_flight: args.concurrency,
        },
        None => Schedule::Closed {
            concurrency: args.concurrency.unwrap_or(1),
        },
    };
    let to_stdout = args.json.as_deref() == Some(std::path::Path::new("-"));
    let run = runner::run(&client, calls, &schedule, true).await;
    let workload = report::Workload {
        prompt: match spec {
            PromptSpec::Tokens { .. } => "tokens",
            PromptSpec::Words { .. } => "words",
            PromptSpec::Repeat { .. } => "repeat",
        }
        .into(),
        prompt_len: args
            .prompt_tokens
            .or(args.prompt_words)
            .or(args.repeat_words)
            .unwrap_or(200),
        max_tokens: args.max_tokens,
        ignore_eos: args.ignore_eos,
        num_requests: args.num_requests,
        concurrency: args
            .concurrency
            .or(args.request_rate.is_none().then_some(1)),
        request_rate: args.request_rate,
        seed: args.seed,
        json_schema: args.json_schema.as_ref().map(|p| p.display().to_string()),
        endpoint: if args.chat { "chat" } else { "completions" }.into(),
        tools: args.tools.as_ref().map(|p| p.display().to_string()),
        tool_choice: args.tools.as_ref().map(|_| args.tool_choice.clone()),
    };
    let report = Report::new(
        client.base.clone(),
        match args.models.len() {
            0 | 1 => client.model.clone(),
            _ => args.models.join(","),
        },
        workload,
        spec.known_tokens(),
        &run.exchanges,
        run.wall,
    );
    let json = serde_json::to_string_pretty(&report)
        .map_err(|e| BenchError::Usage(format!("cannot serialize the report: {e}")))?;
    match &args.json {
        Some(_) if to_stdout => println!("{json}"),
        Some(path) => {
            std::fs::write(path, json + "\n").map_err(|source| BenchError::Write {
                path: path.clone(),
                source,
            })?;
            print!("{}", report.table());
        }
        None => print!("{}", report.table()),
    }
    match report.first_errors.iter().next() {
        Some((kind, message)) => Err(BenchError::Failed {
            failed: report.failed,
            total: args.num_requests,
            first: format!("{kind}: {message}"),
        }),
        None => Ok(()),
    }
}

/// The first model `/v1/models` lists; a clear error when the server cannot be reached or
/// refuses (a wrong key, say), before any load is sent.
async fn served_model(client: &Client, key: Option<&str>) -> Result<String, BenchError> {
    let (status, v) = client
        .get_json("/v1/models", key)
        .await
        .map_err(|message| BenchError::Unreachable {
            url: client.base.clone(),
            message,
        })?;
    if !(200..300).contains(&status) {
        let message = v
            .get("error")
            .and_then(|e| e.get("message"))
            .and_then(Value::as_str)
            .unwrap_or("no error message")
            .to_owned();
        return Err(BenchError::Refused {
            url: format!("{}/v1/models", client.base),
            status,
            message,
        });
    }
    v.get("data")
        .and_then(|d| d.get(0))
        .and_then(|m| m.get("id"))
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| BenchError::NoModel(format!("/v1/models listed none: {v}")))
}
