//! LoRA adapters (llama.cpp's GGUF adapter format): one adapter's low-rank updates, applied
//! per row of a batch on top of the base model's products.
//!
//! An adapter changes every K/V it touches, so what it computes is a function of its
//! weights: the engine puts the adapter's [`LoraAdapter::fingerprint`] into the request's
//! isolation domain (`kv::IsolationDomain::computed_under`), and K/V computed under one
//! adapter can never serve another adapter, the base model, or another tenant.
//!
//! The arithmetic: for a weight `W` with a pair `(A, B)` (A: `rank × n_in`, B:
//! `n_out × rank`, both held as f32), a row's output is `W·x + s·(B·(A·x))` with
//! `s = scale · alpha / rank` (`scale` when alpha is 0), added after the base product and
//! before any bias, as llama.cpp's `build_lora_mm`. Each dot product runs in the one fixed
//! order of `kernels::f32_dot::dot_f32` over that row alone, so a row's bits do not depend
//! on what else is in the batch or on the instruction set.

mod apply;
mod load;
pub mod synth;

pub use apply::{add_lora_rows, RowAdapters, Site, Update};
pub use load::LoraError;
pub use load::{lora_factor, MAX_F32_BYTES, MAX_RANK};

/// What an adapter is checked against: the base model's configuration and whether it has
/// its own output projection ([`crate::Model::lora_base`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraBase {
    pub(crate) config: crate::LlamaConfig,
    pub(crate) own_output: bool,
}

/// Which base-model weight a pair updates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The base tensor's name within a layer (`blk.N.<this>.weight`).
    pub fn tensor(self) -> &'static str {
        match self {
            Target::Q => "attn_q",
            Target::K => "attn_k",
            Target::V => "attn_v",
            Target::O => "attn_output",
            Target::Gate => "ffn_gate",
            Target::Up => "ffn_up",
            Target::Down => "ffn_down",
        }
    }
}

/// One weight's low-rank pair, widened to f32 at load.
#[derive(Clone)]
pub struct LoraPair {
    pub rank: usize,
    pub n_in: usize,
    pub n_out: usize,
    /// `rank` rows of `n_in`.
    pub a: Vec<f32>,
    /// B transposed: `rank` rows of `n_out` (ggml's `lora_b` is `n_out` rows of `rank`;
    /// the loader transposes it), so a row's update is a combination of these rows
    /// (`kernels::add_scaled_combination`).
    pub b: Vec<f32>,
    /// `scale · alpha / rank` (`scale` when alpha is 0).
    pub factor: f32,
}

/// One adapter, checked against the base model it was loaded for.
pub struct LoraAdapter {
    /// Per layer, per [`Target`] (in `Target::ALL`'s order): the pair, if the adapter has one.
    pub(crate) layers: Vec<[Option<LoraPair>; 7]>,
    /// The output projection's pair (only where the model has its own `output.weight`).
    pub(crate) output: Option<LoraPair>,
    /// What the adapter computes, as bytes: a hash of every pair's shapes and f32 values and
    /// of the factor, so two adapters with one fingerprint compute the same K/V.
    fingerprint: u128,
    /// xxh3-128 of the file's bytes: what a disaggregated handoff names.
    file_checksum: u128,
    scale: f32,
    alpha: f32,
    rank: usize,
    bytes: usize,
}

impl LoraAdapter {
    pub fn pair(&self, layer: usize, target: Target) -> Option<&LoraPair> {
        let i = Target::ALL.iter().position(|t| *t == target)?;
        self.layers.get(layer)?[i].as_ref()
    }

    pub fn output_pair(&self) -> Option<&LoraPair> {
        self.output.as_ref()
    }

    /// Whether every pair has the shape of the weight it updates in `base` (what loading
    /// checked against the base it was loaded for): a forward pass refuses a sequence whose
    /// adapter does not fit rather than compute it without some of its updates.
    pub fn fits(&self, base: &LoraBase) -> bool {
        let c = &base.config;
        let pair_fits =
            |p: &LoraPair, (n_in, n_out): (usize, usize)| p.n_in == n_in && p.n_out == n_out;
        self.layers.len() <= c.n_layers
            && self.layers.iter().all(|pairs| {
                pairs.iter().zip(Target::ALL).all(|(p, t)| {
                    p.as_ref()
                        .is_none_or(|p| pair_fits(p, load::base_dims(c, t)))
                })
            })
            && self
                .output
                .as_ref()
                .is_none_or(|p| base.own_output && pair_fits(p, load::output_dims(c)))
    }

    /// Identity of the adapter's arithmetic (weights and factors, so the scale too).
    pub fn fingerprint(&self) -> u128 {
        self.fingerprint
    }

    /// xxh3-128 of the adapter file's bytes.
    pub fn file_checksum(&self) -> u128 {
        self.file_checksum
    }

    pub fn scale(&self) -> f32 {
        self.scale
    }

    pub fn alpha(&self) -> f32 {
        self.alpha
    }

    /// The largest rank of its pairs.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Bytes of f32 weights held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

// Shapes and identities only: a request's debug print must not dump an adapter's weights.
impl std::fmt::Debug for LoraPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoraPair")
            .field("rank", &self.rank)
            .field("n_in", &self.n_in)
            .field("n_out", &self.n_out)
            .field("factor", &self.factor)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for LoraAdapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoraAdapter")
            .field("fingerprint", &format_args!("{:032x}", self.fingerprint))
            .field("rank", &self.rank)
            .field("scale", &self.scale)
            .field("alpha", &self.alpha)
            .finish_non_exhaustive()
    }
}
