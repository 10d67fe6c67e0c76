//! `kvwarden eval`: the accuracy oracle that survives arithmetic changes.
//!
//! Teacher-forced evaluation of a GGUF file over a text, in windows, as llama.cpp's
//! `llama-perplexity` does ([`windows`]): perplexity, and against a reference file of stored
//! log-probabilities ([`logits_file`], llama.cpp's own `--kl-divergence-base` format, read
//! and written) the KL divergence (mean and tail), top-1 agreement, RMS Δp and the number of
//! positions whose stored distribution is bit-identical to the reference ([`row`],
//! [`stats`]). With `--lora PATH[,SCALE]` every row is computed under a LoRA adapter, as
//! llama-perplexity's `--lora` computes it, so an adapter is judged the same way
//! (`scripts/eval-references.py --lora`).
//!
//! Bit-exactness with llama.cpp was the oracle while kvwarden reproduced its plain
//! arithmetic; an arithmetic chosen for speed moves the last bits, and greedy equality on
//! small models is too brittle to judge that (llama.cpp's own two arithmetics disagree that
//! way). What judges it is the measure llama.cpp judges its own quantizations by: the
//! divergence from a reference run, set against the spread between llama.cpp's default and
//! plain paths on the same file (`scripts/eval-references.py` records both and checks the
//! bar).

#![forbid(unsafe_code)]

mod cli;
pub mod logits_file;
pub mod row;
pub mod stats;
pub mod windows;

use std::path::PathBuf;

pub use cli::{evaluate, run_cli, AdapterUsed, EvalArgs, Report};

/// Why an evaluation was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("{}: {reason}", path.display())]
    LogitsFile { path: PathBuf, reason: String },
    #[error("{}: {reason}", path.display())]
    Input { path: PathBuf, reason: String },
    #[error("writing {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The reference does not belong to this model, text or window.
    #[error("{0}")]
    Mismatch(String),
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    #[error(transparent)]
    Tokenizer(#[from] tokenizer::TokenizerError),
    #[error(transparent)]
    Model(#[from] model::ModelError),
    #[error(transparent)]
    Lora(#[from] model::lora::LoraError),
    #[error("KV cache: {0}")]
    Kv(#[from] kv::KvError),
}
