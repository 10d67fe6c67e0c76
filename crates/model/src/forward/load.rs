//! Loading: a GGUF file's tensors into the model's weights, refusing any tensor the
//! architecture would leave unread.

use gguf::GgufFile;

use super::{Layer, Model};
use crate::config::Arch;
use crate::quant::{PendingRepacks, Repack};
use crate::weights::{load_vector, Matrix, QK};
use crate::{LlamaConfig, ModelError};

impl Model {
    /// The model of `file`, its weights repacked (where the CPU runs tiles) before this
    /// returns.
    pub fn load(file: &GgufFile) -> Result<Self, ModelError> {
        Self::load_with(file, &Repack::AtLoad)
    }

    /// The model of `file`, answering at once from the file's rows: the repacks are left
    /// to the returned [`PendingRepacks`], to run beside serving (the same bits either
    /// way). A file read into memory (not mapped) is repacked here, so that it is not held
    /// twice while the repacks wait.
    pub fn load_deferring_repack(file: &GgufFile) -> Result<(Self, PendingRepacks), ModelError> {
        let pending = PendingRepacks::default();
        if !file.is_mapped() {
            return Ok((Self::load(file)?, pending));
        }
        let model = Self::load_with(file, &Repack::Deferred(&pending))?;
        Ok((model, pending))
    }

    fn load_with(file: &GgufFile, repack: &Repack<'_>) -> Result<Self, ModelError> {
        let config = LlamaConfig::from_gguf(file)?;
        let c = &config;
        // Every tensor the file holds must be one this architecture reads: a tensor left
        // unread (an output bias, a fused QKV, LongRoPE factors) would change the answer, so
        // the model is refused naming it instead.
        let used = std::cell::RefCell::new(std::collections::HashSet::<String>::new());
        let tensor = |name: &str| {
            used.borrow_mut().insert(name.to_string());
            file.tensor(name).ok_or_else(|| ModelError::Tensor {
                name: name.to_string(),
                reason: "missing".into(),
            })
        };
        let mat = |name: &str, rows: usize, cols: usize| -> Result<Matrix, ModelError> {
            if !cols.is_multiple_of(QK) {
                return Err(ModelError::Unsupported(format!(
                    "{name}: row length {cols} is not a multiple of {QK}"
                )));
            }
            Matrix::load_with(file, tensor(name)?, rows, cols, repack)
        };
        let vec = |name: &str, len: usize| load_vector(file, tensor(name)?, len);
        let opt_vec = |name: &str, len: usize| match file.tensor(name) {
            Some(_) => vec(name, len).map(Some),
            None => Ok(None),
        };
        let (kv_dim, q_dim, hd) = (c.kv_dim(), c.q_dim(), c.head_dim);
        let qk_norms = matches!(c.arch, Arch::Qwen3 | Arch::Gemma3);
        let post_norms = c.arch == Arch::Gemma3;
        let needed = |on: bool, name: String, len: usize| match on {
            true => vec(&name, len).map(Some),
            false => Ok(None),
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let b = |s: &str| format!("blk.{i}.{s}.bias");
            layers.push(Layer {
                attn_norm: vec(&p("attn_norm"), c.dim)?,
                wq: mat(&p("attn_q"), q_dim, c.dim)?,
                wk: mat(&p("attn_k"), kv_dim, c.dim)?,
                wv: mat(&p("attn_v"), kv_dim, c.dim)?,
                wo: mat(&p("attn_output"), c.dim, q_dim)?,
                ffn_norm: vec(&p("ffn_norm"), c.dim)?,
                w_gate: mat(&p("ffn_gate"), c.ffn_dim, c.dim)?,
                w_up: mat(&p("ffn_up"), c.ffn_dim, c.dim)?,
                w_down: mat(&p("ffn_down"), c.dim, c.ffn_dim)?,
                bq: opt_vec(&b("attn_q"), q_dim)?,
                bk: opt_vec(&b("attn_k"), kv_dim)?,
                bv: opt_vec(&b("attn_v"), kv_dim)?,
                q_norm: needed(qk_norms, p("attn_q_norm"), hd)?,
                k_norm: needed(qk_norms, p("attn_k_norm"), hd)?,
                post_attn_norm: needed(post_norms, p("post_attention_norm"), c.dim)?,
                post_ffn_norm: needed(post_norms, p("post_ffw_norm"), c.dim)?,
            });
        }
        let embed = mat("token_embd.weight", c.vocab_size, c.dim)?;
        let output = match file.tensor("output.weight") {
            Some(_) => Some(mat("output.weight", c.vocab_size, c.dim)?),
            None => None,
        };
        // llama.cpp reads frequency factors for the llama graph only.
        let rope_freqs = if c.arch == Arch::Llama {
            let f = opt_vec("rope_freqs.weight", c.rope_dims / 2)?;
            if let Some(v) = &f {
                if v.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
                    return Err(ModelError::Tensor {
                        name: "rope_freqs.weight".into(),
                        reason: "frequency factors must be finite and positive".into(),
                    });
                }
            }
            f
        } else {
            None
        };
        let output_norm = vec("output_norm.weight", c.dim)?;
        let used = used.into_inner();
        if let Some(extra) = file.tensors().iter().find(|t| !used.contains(&t.name)) {
            return Err(ModelError::Unsupported(format!(
                "tensor {:?} is not used by kvwarden's {} architecture",
                extra.name,
                c.arch.name()
            )));
        }
        let threads = rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("kvwarden-compute-{i}"))
            .build()
            .map_err(|e| ModelError::Unsupported(format!("cannot start compute threads: {e}")))?;
        Ok(Self {
            threads,
            output_norm,
            config,
            embed,
            layers,
            output,
            rope_freqs,
        })
    }
}
