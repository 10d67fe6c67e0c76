use gguf::GgufFile;

use crate::ModelError;

/// Hyperparameters of a llama-family model, every one read from the GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub n_layers: usize,
    pub dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rope_base: f32,
    pub rope_dims: usize,
    pub rms_eps: f32,
    /// End-of-sequence token from the tokenizer metadata, if the file names one.
    pub eos_token: Option<u32>,
}

impl LlamaConfig {
    pub fn from_gguf(f: &GgufFile) -> Result<Self, ModelError> {
        let arch = f.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(ModelError::Unsupported(format!(
                "architecture {arch:?} (only \"llama\" is supported)"
            )));
        }
        let u = |k: &str| -> Result<usize, ModelError> {
            Ok(f.get_u64(&format!("llama.{k}"))? as usize)
        };
        let n_layers = u("block_count")?;
        let dim = u("embedding_length")?;
        let n_heads = u("attention.head_count")?;
        let n_kv_heads = match f.get("llama.attention.head_count_kv") {
            Some(_) => u("attention.head_count_kv")?,
            None => n_heads,
        };
        let ffn_dim = u("feed_forward_length")?;
        let context_length = u("context_length")?;
        let rope_base = match f.get("llama.rope.freq_base") {
            Some(_) => f.get_f64("llama.rope.freq_base")? as f32,
            None => 10_000.0,
        };
        let rms_eps = f.get_f64("llama.attention.layer_norm_rms_epsilon")? as f32;
        let limit = 1 << 20;
        for (name, v) in [
            ("block_count", n_layers),
            ("embedding_length", dim),
            ("attention.head_count", n_heads),
            ("attention.head_count_kv", n_kv_heads),
            ("feed_forward_length", ffn_dim),
        ] {
            if v == 0 || v > limit {
                return Err(ModelError::Unsupported(format!("llama.{name} = {v}")));
            }
        }
        if dim % n_heads != 0 || n_heads % n_kv_heads != 0 {
            return Err(ModelError::Unsupported(format!(
                "{n_heads} heads, {n_kv_heads} KV heads, width {dim}: heads must divide the width and KV heads the heads"
            )));
        }
        let head_dim = dim / n_heads;
        let rope_dims = match f.get("llama.rope.dimension_count") {
            Some(_) => u("rope.dimension_count")?,
            None => head_dim,
        };
        if rope_dims > head_dim || rope_dims % 2 != 0 {
            return Err(ModelError::Unsupported(format!(
                "rope dimension count {rope_dims} with head dim {head_dim}"
            )));
        }
        let vocab_size = match f.get("llama.vocab_size") {
            Some(_) => u("vocab_size")?,
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
        Ok(Self {
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
            rms_eps,
            eos_token: f
                .get("tokenizer.ggml.eos_token_id")
                .and_then(|v| v.as_u64())
                .map(|v| v as u32),
        })
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}
