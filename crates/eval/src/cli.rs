//! The command line: what is judged (a model, or a stored file), against what, over which
//! tokens; every mismatch between them is refused before any window runs.

use std::io::Write;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;

use crate::logits_file::{LogitsReader, LogitsWriter, Shape};
use crate::row::{nll, score_logits, score_stored, StoredRow};
use crate::stats::{Summary, Totals};
use crate::windows::{self, Feeding};
use crate::EvalError;

/// `kvwarden eval` arguments.
#[derive(Debug, clap::Args)]
pub struct EvalArgs {
    /// The GGUF file to evaluate.
    #[arg(long, conflicts_with = "logits", required_unless_present = "logits")]
    pub model: Option<PathBuf>,
    /// Judge a stored file of log-probabilities (this format) instead of a model, against
    /// --kl-base: two builds, two CPU paths or llama.cpp's two arithmetics compared by their
    /// files.
    #[arg(long, requires = "kl_base")]
    pub logits: Option<PathBuf>,
    /// The text to evaluate (tokenized as llama-perplexity does: BOS if the vocabulary asks
    /// for one, control-token text kept as text).
    #[arg(long, conflicts_with = "tokens")]
    pub text: Option<PathBuf>,
    /// The token ids to evaluate instead: a JSON array, or `kvwarden tokenize`'s output.
    #[arg(long)]
    pub tokens: Option<PathBuf>,
    /// Window length; a reference file sets its own.
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Evaluate at most this many windows.
    #[arg(long)]
    pub chunks: Option<usize>,
    /// The reference: llama-perplexity's `--kl-divergence-base` file (or one this writes).
    /// Without --text or --tokens its own tokens are evaluated.
    #[arg(long)]
    pub kl_base: Option<PathBuf>,
    /// Write this run's log-probabilities in the same format (llama-perplexity reads it with
    /// --kl-divergence --kl-divergence-base FILE).
    #[arg(long, conflicts_with = "logits")]
    pub write_base: Option<PathBuf>,
    /// Feed each window in forward steps of this many tokens (chunked prefill); the results
    /// must not change.
    #[arg(long)]
    pub prefill_chunk: Option<usize>,
    /// Windows per forward pass (batching); the results must not change.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// The K/V element type, as `kvwarden serve --kv-dtype` stores it.
    #[arg(long, default_value = "f16", value_parser = ["f16", "f32", "q8_0", "q4_0"])]
    pub kv_dtype: String,
    /// Score the text under a LoRA adapter (llama.cpp's GGUF adapter format), checked
    /// against --model, at SCALE (default 1; llama.cpp's `--lora-scaled FILE SCALE`): what
    /// follows the last comma is the scale when it reads as a number.
    #[arg(long, value_name = "PATH[,SCALE]", conflicts_with = "logits")]
    pub lora: Option<String>,
    /// Print the figures as one JSON object.
    #[arg(long)]
    pub json: bool,
}

const DEFAULT_CTX: usize = 512;

pub fn run_cli(args: EvalArgs) -> Result<(), EvalError> {
    let report = evaluate(&args)?;
    let mut out = std::io::stdout().lock();
    let written = if args.json {
        writeln!(out, "{}", report.json())
    } else {
        write!(out, "{}", report.table())
    };
    written.map_err(|e| EvalError::Write {
        path: PathBuf::from("<stdout>"),
        source: e,
    })
}

/// Runs one evaluation: a model, or a stored file, over the windows the arguments name.
pub fn evaluate(args: &EvalArgs) -> Result<Report, EvalError> {
    if args.batch == 0 || args.prefill_chunk == Some(0) || args.chunks == Some(0) {
        return Err(EvalError::Usage(
            "--batch, --prefill-chunk and --chunks must be at least 1".into(),
        ));
    }
    match &args.model {
        Some(model) => eval_model(model, args),
        None => eval_file(args),
    }
}

/// What one run measured, and on what.
#[derive(Debug)]
pub struct Report {
    pub judged: String,
    pub base: Option<String>,
    pub text: Option<String>,
    pub shape: Shape,
    /// The kernels' instruction-set path (a model run).
    pub cpu: Option<&'static str>,
    pub feeding: Feeding,
    /// The LoRA adapter the model was run under (a model run with --lora).
    pub adapter: Option<AdapterUsed>,
    pub summary: Summary,
}

/// The adapter a run scored under, as loaded.
#[derive(Debug, Clone)]
pub struct AdapterUsed {
    pub path: String,
    pub scale: f32,
    pub alpha: f32,
    /// The largest rank of its pairs.
    pub rank: usize,
}

fn eval_model(model_path: &Path, args: &EvalArgs) -> Result<Report, EvalError> {
    let file = gguf::GgufFile::open(model_path)?;
    let tok = tokenizer::Tokenizer::from_gguf(&file)?;
    let model = model::Model::load(&file)?;
    drop(file);
    let adapter = args
        .lora
        .as_deref()
        .map(|spec| {
            let (path, scale) = lora_spec(spec)?;
            model::lora::LoraAdapter::load_path(&path, &model.lora_base(), scale)
                .map(|adapter| (path, adapter))
                .map_err(EvalError::from)
        })
        .transpose()?;
    let vocab = model.config.vocab_size;
    let mut base = args
        .kl_base
        .as_deref()
        .map(LogitsReader::open)
        .transpose()?;
    if let Some(b) = &base {
        if b.shape.n_vocab != vocab {
            return Err(EvalError::Mismatch(format!(
                "{} was written for a vocabulary of {} tokens; {} has {vocab}: a reference \
                 for another model",
                b.path().display(),
                b.shape.n_vocab,
                model_path.display()
            )));
        }
    }
    let ours = match (&args.text, &args.tokens) {
        (Some(text), _) => {
            let raw = std::fs::read_to_string(text).map_err(|e| EvalError::Input {
                path: text.clone(),
                reason: format!("cannot read the text: {e}"),
            })?;
            Some(tok.with_bos(tok.encode_ordinary(&raw)))
        }
        (None, Some(path)) => Some(read_tokens(path, vocab)?),
        (None, None) => None,
    };
    let (shape, tokens) = windows_of(args, base.as_ref(), ours, vocab)?;
    if shape.n_ctx > model.config.context_length {
        return Err(EvalError::Usage(format!(
            "a window of {} tokens exceeds {}'s context of {}",
            shape.n_ctx,
            model_path.display(),
            model.config.context_length
        )));
    }
    let mut writer = args
        .write_base
        .as_deref()
        .map(|p| LogitsWriter::create(p, shape, &tokens))
        .transpose()?;
    let bos = if tok.add_bos() { tok.bos_id() } else { None };
    let feeding = Feeding {
        chunk: args.prefill_chunk,
        batch: args.batch,
        // The parser admitted only the types' names.
        kv_dtype: kv::KvDtype::from_name(&args.kv_dtype).unwrap_or(kv::KvDtype::F16),
    };
    let per_element = feeding.kv_dtype.values_per_element();
    if !model.config.head_dim.is_multiple_of(per_element) {
        return Err(EvalError::Usage(format!(
            "--kv-dtype {} stores K/V in blocks of {per_element} values; this model's attention heads have {}",
            feeding.kv_dtype.name(),
            model.config.head_dim
        )));
    }
    let mut totals = if base.is_some() {
        Totals::with_base()
    } else {
        Totals::default()
    };
    let progress = progress_bar(shape.n_chunk);
    let lora = adapter.as_ref().map(|(_, a)| a);
    windows::run(&model, lora, bos, shape, &tokens, feeding, |w, logits| {
        let next = |r: usize| tokens[w * shape.n_ctx + shape.first() + r + 1] as usize;
        let rows = logits.chunks_exact(shape.n_vocab);
        let stored: Option<Vec<StoredRow>> = (writer.is_some() || base.is_some())
            .then(|| rows.clone().map(StoredRow::from_logits).collect());
        match (&mut base, &stored) {
            (Some(reader), Some(stored)) => {
                let reference = reader.next_chunk()?;
                for (r, l) in rows.enumerate() {
                    let score = score_logits(l, &reference[r], next(r));
                    totals.add_scored(score, bit_identical(&stored[r], &reference[r]));
                }
            }
            _ => rows
                .enumerate()
                .for_each(|(r, l)| totals.add_nll(nll(l, next(r)))),
        }
        if let (Some(w), Some(stored)) = (&mut writer, &stored) {
            w.write_chunk(stored)?;
        }
        progress.inc(1);
        Ok(())
    })?;
    progress.finish_and_clear();
    if let Some(w) = writer {
        w.finish()?;
    }
    Ok(Report {
        judged: model_path.display().to_string(),
        base: args.kl_base.as_ref().map(|p| p.display().to_string()),
        text: args
            .text
            .as_ref()
            .or(args.tokens.as_ref())
            .map(|p| p.display().to_string()),
        shape,
        cpu: Some(model::kernels::cpu_path()),
        feeding,
        adapter: adapter.map(|(path, a)| AdapterUsed {
            path: path.display().to_string(),
            scale: a.scale(),
            alpha: a.alpha(),
            rank: a.rank(),
        }),
        summary: totals.summary(),
    })
}

/// `PATH[,SCALE]`: the scale is what follows the last comma when that reads as a finite
/// number, so a path that itself holds a comma still loads at scale 1.
fn lora_spec(spec: &str) -> Result<(PathBuf, f32), EvalError> {
    let (path, scale) = match spec.rsplit_once(',') {
        Some((path, tail)) => match tail.trim().parse::<f32>() {
            Ok(scale) => (path, scale),
            Err(_) => (spec, 1.0),
        },
        None => (spec, 1.0),
    };
    if path.is_empty() {
        return Err(EvalError::Usage(format!(
            "--lora {spec:?}: no adapter path (PATH[,SCALE])"
        )));
    }
    if !scale.is_finite() {
        return Err(EvalError::Usage(format!(
            "--lora {spec:?}: the scale {scale} is not finite"
        )));
    }
    Ok((PathBuf::from(path), scale))
}

fn eval_file(args: &EvalArgs) -> Result<Report, EvalError> {
    let (Some(judged_path), Some(base_path)) = (&args.logits, &args.kl_base) else {
        return Err(EvalError::Usage(
            "give --model, or --logits with --kl-base".into(),
        ));
    };
    if args.text.is_some() || args.tokens.is_some() || args.ctx.is_some() {
        return Err(EvalError::Usage(
            "--logits compares two stored files over their own tokens: --text, --tokens \
             and --ctx do not apply"
                .into(),
        ));
    }
    let mut judged = LogitsReader::open(judged_path)?;
    let mut base = LogitsReader::open(base_path)?;
    let (a, b) = (judged.shape, base.shape);
    if (a.n_ctx, a.n_vocab) != (b.n_ctx, b.n_vocab) {
        return Err(EvalError::Mismatch(format!(
            "{} holds windows of {} tokens over a vocabulary of {}, {} windows of {} over {}",
            judged_path.display(),
            a.n_ctx,
            a.n_vocab,
            base_path.display(),
            b.n_ctx,
            b.n_vocab
        )));
    }
    let n_chunk = a
        .n_chunk
        .min(b.n_chunk)
        .min(args.chunks.unwrap_or(usize::MAX));
    let span = n_chunk * a.n_ctx;
    first_difference(&judged.tokens[..span], &base.tokens[..span])
        .map_or(Ok(()), |at| Err(token_mismatch(at, &base, &judged.tokens)))?;
    let shape = Shape { n_chunk, ..a };
    let mut totals = Totals::with_base();
    let progress = progress_bar(n_chunk);
    for w in 0..n_chunk {
        let ours = judged.next_chunk()?;
        let reference = base.next_chunk()?;
        for (r, (o, b)) in ours.iter().zip(&reference).enumerate() {
            let next = base.tokens[w * shape.n_ctx + shape.first() + r + 1] as usize;
            totals.add_scored(score_stored(o, b, next), bit_identical(o, b));
        }
        progress.inc(1);
    }
    progress.finish_and_clear();
    Ok(Report {
        judged: judged_path.display().to_string(),
        base: Some(base_path.display().to_string()),
        text: None,
        shape,
        cpu: None,
        feeding: Feeding::default(),
        adapter: None,
        summary: totals.summary(),
    })
}

/// The windows to run and their tokens: the reference's, checked against the text's when
/// both are given; otherwise the text's, cut as llama-perplexity cuts them.
fn windows_of(
    args: &EvalArgs,
    base: Option<&LogitsReader>,
    ours: Option<Vec<u32>>,
    n_vocab: usize,
) -> Result<(Shape, Vec<u32>), EvalError> {
    let limit = args.chunks.unwrap_or(usize::MAX);
    if let Some(base) = base {
        if let Some(ctx) = args.ctx.filter(|&c| c != base.shape.n_ctx) {
            return Err(EvalError::Mismatch(format!(
                "{} was recorded with windows of {} tokens, not {ctx}",
                base.path().display(),
                base.shape.n_ctx
            )));
        }
        let shape = Shape {
            n_chunk: base.shape.n_chunk.min(limit),
            ..base.shape
        };
        let span = shape.n_chunk * shape.n_ctx;
        if let Some(ours) = ours {
            let common = ours.len().min(span);
            if let Some(at) = first_difference(&ours[..common], &base.tokens[..common]) {
                return Err(token_mismatch(at, base, &ours));
            }
            if ours.len() < span {
                return Err(EvalError::Mismatch(format!(
                    "this text tokenizes to {} tokens; {} evaluated {span} ({} windows of {})",
                    ours.len(),
                    base.path().display(),
                    shape.n_chunk,
                    shape.n_ctx
                )));
            }
        }
        return Ok((shape, base.tokens[..span].to_vec()));
    }
    let Some(tokens) = ours else {
        return Err(EvalError::Usage(
            "give --text or --tokens (or --kl-base, whose tokens are then evaluated)".into(),
        ));
    };
    let n_ctx = args.ctx.unwrap_or(DEFAULT_CTX);
    if n_ctx < 4 {
        return Err(EvalError::Usage(format!(
            "a window of {n_ctx} tokens scores nothing (4 at least)"
        )));
    }
    if tokens.len() < 2 * n_ctx {
        return Err(EvalError::Usage(format!(
            "the text tokenizes to {} tokens; windows of {n_ctx} need at least {} \
             (llama-perplexity's rule: twice the window)",
            tokens.len(),
            2 * n_ctx
        )));
    }
    let shape = Shape {
        n_ctx,
        n_vocab,
        n_chunk: (tokens.len() / n_ctx).min(limit),
    };
    Ok((shape, tokens[..shape.n_chunk * n_ctx].to_vec()))
}

fn first_difference(a: &[u32], b: &[u32]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

fn token_mismatch(at: usize, base: &LogitsReader, ours: &[u32]) -> EvalError {
    EvalError::Mismatch(format!(
        "{} evaluated other tokens: token {at} is {} there, {} here (another text, or \
         another tokenizer)",
        base.path().display(),
        base.tokens[at],
        ours[at]
    ))
}

/// Bit for bit, so a -0.0 scale or a NaN does not pass for equal.
fn bit_identical(a: &StoredRow, b: &StoredRow) -> bool {
    a.scale.to_bits() == b.scale.to_bits()
        && a.min_log_prob.to_bits() == b.min_log_prob.to_bits()
        && a.q == b.q
}

fn read_tokens(path: &Path, vocab: usize) -> Result<Vec<u32>, EvalError> {
    let bad = |reason: String| EvalError::Input {
        path: path.to_path_buf(),
        reason,
    };
    let raw = std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read: {e}")))?;
    let value: serde_json::Value = serde_json::from_str(&raw)
        .map_err(|e| bad(format!("not JSON (a token-id array expected): {e}")))?;
    let list = match &value {
        serde_json::Value::Array(list) => list,
        serde_json::Value::Object(o) => match o.get("tokens") {
            Some(serde_json::Value::Array(list)) => list,
            _ => return Err(bad("an object without a \"tokens\" array".into())),
        },
        _ => return Err(bad("a token-id array expected".into())),
    };
    list.iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .filter(|&id| (id as usize) < vocab)
                .map(|id| id as u32)
                .ok_or_else(|| bad(format!("entry {i} ({v}) is not a token id below {vocab}")))
        })
        .collect()
}

fn progress_bar(windows: usize) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(windows as u64), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} windows")
    {
        bar.set_style(style);
    }
    bar
}

impl Report {
    pub fn json(&self) -> serde_json::Value {
        let mut v = json!({
            "judged": self.judged,
            "base": self.base,
            "text": self.text,
            "n_ctx": self.shape.n_ctx,
            "windows": self.shape.n_chunk,
            "cpu": self.cpu,
            "prefill_chunk": self.feeding.chunk,
            "batch": self.feeding.batch,
            "lora": self.adapter.as_ref().map(|a| json!({
                "path": a.path,
                "scale": a.scale,
                "alpha": a.alpha,
                "rank": a.rank,
            })),
        });
        if let (Some(obj), Ok(serde_json::Value::Object(s))) =
            (v.as_object_mut(), serde_json::to_value(&self.summary))
        {
            obj.extend(s);
        }
        v
    }

    pub fn table(&self) -> String {
        let s = &self.summary;
        let mut t = format!(
            "kvwarden eval: {}{}\n{} windows of {} tokens, {} positions scored{}\n\
             PPL                  {:.4} ± {:.5}\n",
            self.judged,
            self.text
                .as_ref()
                .map(|t| format!(" on {t}"))
                .unwrap_or_default(),
            self.shape.n_chunk,
            self.shape.n_ctx,
            s.tokens_scored,
            self.cpu
                .map(|c| format!(" ({c} kernels)"))
                .unwrap_or_default(),
            s.ppl,
            s.ppl_unc
        );
        if let Some(a) = &self.adapter {
            t += &format!(
                "under LoRA adapter {} (scale {}, alpha {}, rank {})\n",
                a.path, a.scale, a.alpha, a.rank
            );
        }
        if let (Some(base), Some(b)) = (&self.base, &s.base) {
            t += &format!(
                "against {base}:\n\
                 PPL(base)            {:.4} ± {:.5}\n\
                 ln(PPL/PPL(base))    {:.6}\n\
                 KL divergence mean   {:.6} ± {:.6}\n\
                 \x20             median {:.6}\n\
                 \x20             99%    {:.6}\n\
                 \x20             99.9%  {:.6}\n\
                 \x20             max    {:.6}\n\
                 RMS Δp               {:.3} %\n\
                 same top-1           {:.3} %\n\
                 identical rows       {} of {}\n",
                b.ppl_base,
                b.ppl_base_unc,
                b.ln_ppl_ratio,
                b.kld_mean,
                b.kld_unc,
                b.kld_median,
                b.kld_p99,
                b.kld_p999,
                b.kld_max,
                100.0 * b.rms_dp,
                100.0 * b.same_top,
                b.identical_rows,
                s.tokens_scored
            );
        }
        t
    }
}
