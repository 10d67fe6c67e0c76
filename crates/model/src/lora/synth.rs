//! Synthetic LoRA adapters with deterministic random weights, written in llama.cpp's GGUF
//! adapter format (the metadata `convert_lora_to_gguf.py` writes) for a base model file's
//! architecture and shapes, so tests and `kvwarden synth-lora` exercise the same loader as
//! a real adapter.
//!
//! Trained adapters start with B at zero; here both halves are random, so the adapter
//! changes what the model computes from the first token. Each tensor's values come from a
//! stream of its own (seeded by the seed, its layer, its weight and its half), so one
//! weight's pair is the same whatever else the adapter holds.

use std::path::Path;

use gguf::{GgmlType, GgufFile, GgufWriter, Load, MetaValue};

use super::load::{base_dims, output_dims, MAX_F32_BYTES, MAX_RANK};
use super::Target;
use crate::LlamaConfig;

/// Why a synthetic adapter could not be made.
#[derive(Debug, thiserror::Error)]
pub enum SynthLoraError {
    // As in `LoraError`, causes are in the messages only, so a chain prints each once.
    #[error("base model: {0}")]
    Base(crate::ModelError),
    #[error("{0}")]
    Spec(String),
    #[error("cannot write {path}: {error}")]
    Io { path: String, error: std::io::Error },
}

impl From<crate::ModelError> for SynthLoraError {
    fn from(e: crate::ModelError) -> Self {
        SynthLoraError::Base(e)
    }
}

impl From<gguf::GgufError> for SynthLoraError {
    fn from(e: gguf::GgufError) -> Self {
        SynthLoraError::Base(crate::ModelError::Gguf(e))
    }
}

pub const DEFAULT_RANK: usize = 16;
pub const DEFAULT_ALPHA: f32 = 32.0;
/// B's values are `U(-1, 1) · magnitude / sqrt(rank)` (A's `U(-1, 1) / sqrt(n_in)`).
pub const DEFAULT_MAGNITUDE: f32 = 0.5;
/// The names `--targets` takes, in [`Target::ALL`]'s order, then the output projection.
pub const TARGET_NAMES: &str = "q,k,v,o,gate,up,down,output";

/// The tensor types an adapter may be written in, by the names `--type` takes.
pub fn tensor_type_by_name(name: &str) -> Option<GgmlType> {
    match name {
        "f32" => Some(GgmlType::F32),
        "f16" => Some(GgmlType::F16),
        "bf16" => Some(GgmlType::BF16),
        "q8_0" => Some(GgmlType::Q8_0),
        _ => None,
    }
}

/// Shape, seed and content of a synthetic adapter.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    pub rank: usize,
    pub alpha: f32,
    pub seed: u64,
    /// The layer weights adapted, in every layer.
    pub targets: Vec<Target>,
    /// Whether the output projection is adapted too (only a base model with its own
    /// `output.weight` has one to adapt).
    pub output: bool,
    /// F32, F16, BF16 or Q8_0 (whose blocks need `n_in` and the rank to be multiples of 32).
    pub tensor_type: GgmlType,
    /// Scale of B's values ([`DEFAULT_MAGNITUDE`]).
    pub magnitude: f32,
}

impl Default for LoraSpec {
    fn default() -> Self {
        Self {
            rank: DEFAULT_RANK,
            alpha: DEFAULT_ALPHA,
            seed: 0,
            targets: Target::ALL.to_vec(),
            output: false,
            tensor_type: GgmlType::F32,
            magnitude: DEFAULT_MAGNITUDE,
        }
    }
}

/// One pair as generated, before it is stored in the file's tensor type.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthPair {
    /// The base weight's name (`blk.0.attn_q.weight`, `output.weight`).
    pub base: String,
    pub rank: usize,
    pub n_in: usize,
    pub n_out: usize,
    /// `rank` rows of `n_in` (ggml dims `[n_in, rank]`, as `lora_a` is stored).
    pub a: Vec<f32>,
    /// `n_out` rows of `rank` (ggml dims `[rank, n_out]`, as `lora_b` is stored).
    pub b: Vec<f32>,
}

impl LoraSpec {
    /// Sets the targets from a comma-separated list of [`TARGET_NAMES`].
    pub fn set_targets(&mut self, list: &str) -> Result<(), SynthLoraError> {
        let mut targets = Vec::new();
        let mut output = false;
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let target = match name {
                "q" => Target::Q,
                "k" => Target::K,
                "v" => Target::V,
                "o" => Target::O,
                "gate" => Target::Gate,
                "up" => Target::Up,
                "down" => Target::Down,
                "output" => {
                    output = true;
                    continue;
                }
                other => {
                    return Err(SynthLoraError::Spec(format!(
                        "unknown target {other:?} (targets: {TARGET_NAMES})"
                    )))
                }
            };
            if !targets.contains(&target) {
                targets.push(target);
            }
        }
        if targets.is_empty() && !output {
            return Err(SynthLoraError::Spec(format!(
                "no targets given (targets: {TARGET_NAMES})"
            )));
        }
        // Kept in one order whatever the list's, so a list names one adapter.
        targets.sort_by_key(|t| Target::ALL.iter().position(|a| a == t));
        self.targets = targets;
        self.output = output;
        Ok(())
    }

    /// The pairs for `base`'s shapes, as generated (f32, before the file's tensor type).
    pub fn pairs(&self, base: &GgufFile) -> Result<Vec<SynthPair>, SynthLoraError> {
        let c = LlamaConfig::from_gguf(base)?;
        self.check(&c, base.tensor("output.weight").is_some())?;
        let mut pairs = Vec::new();
        for l in 0..c.n_layers {
            for (i, &t) in Target::ALL.iter().enumerate() {
                if self.targets.contains(&t) {
                    let (n_in, n_out) = base_dims(&c, t);
                    let name = format!("blk.{l}.{}.weight", t.tensor());
                    pairs.push(self.pair(name, ((l as u64) << 8) | i as u64, n_in, n_out));
                }
            }
        }
        if self.output {
            let (n_in, n_out) = output_dims(&c);
            pairs.push(self.pair("output.weight".into(), u64::MAX, n_in, n_out));
        }
        Ok(pairs)
    }

    /// The adapter file for `base`, ready to write (tests edit it before writing).
    pub fn build(&self, base: &GgufFile) -> Result<GgufWriter, SynthLoraError> {
        let pairs = self.pairs(base)?;
        let arch = LlamaConfig::from_gguf(base)?.arch.name();
        let mut w = GgufWriter::new();
        let s = |v: &str| MetaValue::String(v.to_string());
        w.meta("general.architecture", s(arch));
        w.meta("general.type", s("adapter"));
        w.meta("general.name", s("kvwarden-synthetic-lora"));
        w.meta("adapter.type", s("lora"));
        w.meta("adapter.lora.alpha", MetaValue::F32(self.alpha));
        let (r, ty) = (|v: usize| v as u64, self.tensor_type);
        for p in &pairs {
            let a = format!("{}.lora_a", p.base);
            let b = format!("{}.lora_b", p.base);
            w.tensor_f32(&a, &[r(p.n_in), r(p.rank)], ty, &p.a);
            w.tensor_f32(&b, &[r(p.rank), r(p.n_out)], ty, &p.b);
        }
        Ok(w)
    }

    fn check(&self, c: &LlamaConfig, has_output: bool) -> Result<(), SynthLoraError> {
        let bad = |m: String| Err(SynthLoraError::Spec(m));
        if self.targets.is_empty() && !self.output {
            return bad("no targets".into());
        }
        if self.output && !has_output {
            return bad(
                "the base model ties its output projection to its token embeddings \
                        (no output.weight): an adapter cannot change it"
                    .into(),
            );
        }
        if !(self.alpha.is_finite() && self.alpha >= 0.0) {
            return bad(format!(
                "alpha {} must be finite and at least 0",
                self.alpha
            ));
        }
        if !self.magnitude.is_finite() {
            return bad(format!("magnitude {} must be finite", self.magnitude));
        }
        let ty = self.tensor_type;
        if !matches!(
            ty,
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0
        ) {
            return bad(format!(
                "tensor type {ty:?} (adapters: f32, f16, bf16, q8_0)"
            ));
        }
        let mut shapes: Vec<(usize, usize)> =
            self.targets.iter().map(|&t| base_dims(c, t)).collect();
        if self.output {
            shapes.push(output_dims(c));
        }
        let mut bytes = 0u64;
        for (n_in, n_out) in shapes {
            let bound = n_in.min(n_out).min(MAX_RANK);
            if self.rank == 0 || self.rank > bound {
                return bad(format!(
                    "rank {} is not between 1 and {bound} (for a weight of [{n_in}, {n_out}])",
                    self.rank
                ));
            }
            let block = ty.block_elems();
            if !n_in.is_multiple_of(block) || !self.rank.is_multiple_of(block) {
                return bad(format!(
                    "{ty:?} stores rows in blocks of {block}: n_in {n_in} and rank {} must \
                     be multiples of it",
                    self.rank
                ));
            }
            bytes += 4 * (self.rank * (n_in + n_out)) as u64 * c.n_layers as u64;
        }
        if bytes > MAX_F32_BYTES {
            return bad(format!(
                "{bytes} bytes of f32 weights (limit {MAX_F32_BYTES})"
            ));
        }
        Ok(())
    }

    fn pair(&self, base: String, site: u64, n_in: usize, n_out: usize) -> SynthPair {
        let rank = self.rank;
        let mut ra = Rng::new(self.seed, site, 0);
        let mut rb = Rng::new(self.seed, site, 1);
        let (sa, sb) = (
            1.0 / (n_in as f32).sqrt(),
            self.magnitude / (rank as f32).sqrt(),
        );
        SynthPair {
            base,
            rank,
            n_in,
            n_out,
            a: (0..rank * n_in).map(|_| ra.uniform() * sa).collect(),
            b: (0..n_out * rank).map(|_| rb.uniform() * sb).collect(),
        }
    }
}

/// Writes `spec`'s adapter for the base model at `base` (whose metadata only is read) to
/// `out`.
pub fn write_synthetic_lora(
    base: &Path,
    out: &Path,
    spec: &LoraSpec,
) -> Result<(), SynthLoraError> {
    let file = GgufFile::open_with(base, Load::Map)?;
    spec.build(&file)?
        .write_to(out)
        .map_err(|error| SynthLoraError::Io {
            path: out.display().to_string(),
            error,
        })
}

/// xorshift64*, one stream per tensor: its state mixed from the seed and the tensor's place
/// (splitmix64), so streams of neighbouring tensors and seeds are unrelated.
struct Rng(u64);

impl Rng {
    fn new(seed: u64, site: u64, half: u64) -> Self {
        let state = splitmix(seed ^ splitmix(site.wrapping_mul(2).wrapping_add(half)));
        // xorshift's one fixed point.
        Rng(if state == 0 {
            0x9E37_79B9_7F4A_7C15
        } else {
            state
        })
    }

    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        let bits = x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        (bits as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
