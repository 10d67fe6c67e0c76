//! A model's hyperparameters, every one read from its GGUF metadata and checked at load;
//! keys that would change the graph in ways this forward pass does not implement are refused.

use gguf::GgufFile;

use crate::ModelError;

mod end_tokens;
mod gemma3;

/// The GGUF `general.architecture` values this forward pass implements. Each is the llama
/// block (RMSNorm, rotary attention with grouped KV heads, SwiGLU) with its own additions,
/// as llama.cpp's `src/models/{llama,qwen2,qwen3,gemma3}.cpp` build them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 1/2/3, Mistral, SmolLM: rotary pairs of adjacent dimensions, optional
    /// `rope_freqs.weight` frequency factors (Llama 3.1's RoPE scaling).
    Llama,
    /// Qwen 2 / 2.5: Q, K and V projections carry biases; rotary halves (NeoX layout).
    Qwen2,
    /// Qwen 3: an RMSNorm over each Q and K head before the rotation; rotary halves.
    Qwen3,
    /// Gemma 3: Qwen 3's head norms plus post-attention and post-FFN norms, GeGLU, scaled
    /// embeddings and sliding-window layers (`crate::gemma3`).
    Gemma3,
}

impl Arch {
    pub const SUPPORTED: &'static str = "llama, qwen2, qwen3, gemma3";

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            "gemma3" => Some(Arch::Gemma3),
            _ => None,
        }
    }

    /// The prefix of this architecture's metadata keys (`qwen2.block_count`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
        }
    }

    /// Whether rotary pairs are `(i, i + n/2)` (ggml's NEOX mode, which llama.cpp uses for
    /// the Qwen and Gemma families) rather than adjacent `(2i, 2i + 1)` (NORMAL, llama).
    pub fn rope_neox(self) -> bool {
        !matches!(self, Arch::Llama)
    }
}

/// The feed-forward's gated activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnAct {
    /// SwiGLU: `silu(gate) * up`.
    Silu,
    /// GeGLU with ggml's tanh-approximated GELU: `gelu(gate) * up`.
    GeluTanh,
}

/// How one layer attends: which past positions, and the rotation of its Q and K.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerAttention {
    /// `Some(w)`: a query at position `p` sees only positions `p - w + 1 ..= p` (llama.cpp's
    /// standard sliding window); `None`: every earlier position.
    pub window: Option<usize>,
    pub rope_base: f32,
    /// ggml's `freq_scale`: 1 / `rope.scaling.factor` for linear scaling, else 1.
    pub rope_freq_scale: f32,
}

/// Hyperparameters of a llama-family model, every one read from the GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub arch: Arch,
    pub n_layers: usize,
    pub dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Width of one attention head (`attention.key_length`, default `dim / n_heads`); Qwen 3
    /// has `n_heads * head_dim != dim`.
    pub head_dim: usize,
    pub ffn_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rope_base: f32,
    pub rope_dims: usize,
    /// ggml's `freq_scale`: 1 / `rope.scaling.factor` for linear scaling, else 1.
    pub rope_freq_scale: f32,
    pub rms_eps: f32,
    /// End-of-sequence token from the tokenizer metadata, if the file names one.
    pub eos_token: Option<u32>,
    /// Every token that ends a generation, sorted: llama.cpp's end-of-generation set
    /// (`end_tokens.rs`), the end-of-sequence token among them.
    pub end_tokens: Vec<u32>,
    /// Per layer: window and RoPE (all alike but in Gemma 3).
    pub layers: Vec<LayerAttention>,
    /// Factor applied to token embeddings before the first layer (Gemma: `sqrt(dim)`).
    pub embed_scale: Option<f32>,
    /// Factor applied to Q before attention, whose scores are then not scaled again
    /// (Gemma's `query_pre_attn_scalar`); `None`: scores scaled by `1 / sqrt(head_dim)`.
    pub q_scale: Option<f32>,
    pub ffn_act: FfnAct,
}

impl LlamaConfig {
    pub fn from_gguf(f: &GgufFile) -> Result<Self, ModelError> {
        let arch_name = f.get_str("general.architecture")?;
        let arch = Arch::from_name(arch_name).ok_or_else(|| {
            ModelError::Unsupported(format!(
                "architecture {arch_name:?} (supported: {})",
                Arch::SUPPORTED
            ))
        })?;
        let a = arch.name();
        let key = |k: &str| format!("{a}.{k}");
        let u = |k: &str| -> Result<usize, ModelError> { Ok(f.get_u64(&key(k))? as usize) };
        let opt_u = |k: &str| -> Result<Option<usize>, ModelError> {
            match f.get(&key(k)) {
                Some(_) => Ok(Some(u(k)?)),
                None => Ok(None),
            }
        };
        let opt_f = |k: &str| -> Result<Option<f64>, ModelError> {
            match f.get(&key(k)) {
                Some(_) => Ok(Some(f.get_f64(&key(k))?)),
                None => Ok(None),
            }
        };
        let n_layers = u("block_count")?;
        let dim = u("embedding_length")?;
        let n_heads = u("attention.head_count")?;
        let n_kv_heads = opt_u("attention.head_count_kv")?.unwrap_or(n_heads);
        let ffn_dim = u("feed_forward_length")?;
        let context_length = u("context_length")?;
        let rope_base = opt_f("rope.freq_base")?.unwrap_or(10_000.0) as f32;
        let rms_eps = f.get_f64(&key("attention.layer_norm_rms_epsilon"))? as f32;
        let limit = 1 << 20;
        for (name, v) in [
            ("block_count", n_layers),
            ("embedding_length", dim),
            ("attention.head_count", n_heads),
            ("attention.head_count_kv", n_kv_heads),
            ("feed_forward_length", ffn_dim),
        ] {
            if v == 0 || v > limit {
                return Err(ModelError::Unsupported(format!("{a}.{name} = {v}")));
            }
        }
        if n_heads % n_kv_heads != 0 {
            return Err(ModelError::Unsupported(format!(
                "{n_heads} heads, {n_kv_heads} KV heads: KV heads must divide the heads"
            )));
        }
        let head_dim = match opt_u("attention.key_length")? {
            Some(k) => k,
            None if dim % n_heads == 0 => dim / n_heads,
            None => {
                return Err(ModelError::Unsupported(format!(
                    "{n_heads} heads do not divide the width {dim} and the file gives no key length"
                )))
            }
        };
        let value_dim = opt_u("attention.value_length")?.unwrap_or(head_dim);
        if head_dim == 0 || head_dim > limit || value_dim != head_dim {
            return Err(ModelError::Unsupported(format!(
                "key length {head_dim} and value length {value_dim} (they must be equal and positive)"
            )));
        }
        let rope_dims = opt_u("rope.dimension_count")?.unwrap_or(head_dim);
        if rope_dims > head_dim || rope_dims % 2 != 0 || rope_dims == 0 {
            return Err(ModelError::Unsupported(format!(
                "rope dimension count {rope_dims} with head dim {head_dim}"
            )));
        }
        // llama.cpp's default scaling type is "linear", whose factor defaults to 1 (none).
        // YaRN and LongRoPE change the angles and magnitudes in ways not implemented here:
        // refused rather than run with the wrong positions.
        let scaling = match f.get(&key("rope.scaling.type")) {
            Some(_) => f.get_str(&key("rope.scaling.type"))?,
            None => "linear",
        };
        let factor = match opt_f("rope.scaling.factor")? {
            Some(v) => v,
            None => opt_f("rope.scale_linear")?.unwrap_or(0.0),
        } as f32;
        let rope_freq_scale = match scaling {
            "none" => 1.0,
            "linear" if factor == 0.0 => 1.0,
            "linear" if factor.is_finite() && factor > 0.0 => 1.0 / factor,
            other => {
                return Err(ModelError::Unsupported(format!(
                    "RoPE scaling {other:?} with factor {factor} (supported: none, linear)"
                )))
            }
        };
        if let Some(af) = opt_f("rope.scaling.attn_factor")? {
            if af != 1.0 {
                return Err(ModelError::Unsupported(format!(
                    "RoPE attention factor {af} (only 1 is supported)"
                )));
            }
        }
        // Keys that change llama.cpp's graph in ways this pass does not implement: refused
        // rather than ignored (a Mixtral file says `llama` too).
        if let Some(n) = opt_u("expert_count")? {
            if n > 0 {
                return Err(ModelError::Unsupported(format!(
                    "mixture of experts ({a}.expert_count = {n})"
                )));
            }
        }
        for k in ["attention.scale", "attention.clamp_kqv"] {
            if let Some(v) = opt_f(k)? {
                if v != 0.0 {
                    return Err(ModelError::Unsupported(format!("{a}.{k} = {v}")));
                }
            }
        }
        let vocab_size = match opt_u("vocab_size")? {
            Some(v) => v,
            None => f.get_array("tokenizer.ggml.tokens")?.len(),
        };
        if context_length == 0 {
            return Err(ModelError::Unsupported("context length 0".into()));
        }
        let plausible = rms_eps > 0.0 && rms_eps < 1.0 && rope_base > 1.0 && rope_base.is_finite();
        if !plausible {
            return Err(ModelError::Unsupported(format!(
                "rms eps {rms_eps}, rope base {rope_base}"
            )));
        }
        let gemma = match arch {
            Arch::Gemma3 => Some(gemma3::read(
                f,
                &gemma3::Dims {
                    n_layers,
                    dim,
                    n_heads,
                    head_dim,
                    rope_base,
                    rope_freq_scale,
                },
            )?),
            _ => None,
        };
        let layers = match &gemma {
            Some(g) => g.layers.clone(),
            None => vec![
                LayerAttention {
                    window: None,
                    rope_base,
                    rope_freq_scale,
                };
                n_layers
            ],
        };
        Ok(Self {
            layers,
            embed_scale: gemma.as_ref().map(|g| g.embed_scale),
            q_scale: gemma.as_ref().map(|g| g.q_scale),
            ffn_act: gemma.as_ref().map_or(FfnAct::Silu, |g| g.ffn_act),
            arch,
            n_layers,
            dim,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim,
            vocab_size,
            context_length,
            rope_base,
            rope_dims,
            rope_freq_scale,
            rms_eps,
            eos_token: f
                .get("tokenizer.ggml.eos_token_id")
                .and_then(|v| v.as_u64())
                .map(|v| v as u32),
            end_tokens: end_tokens::end_tokens(f, vocab_size),
        })
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Width of the concatenated query heads (the attention output's width too).
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
}
