//! Gemma 3's metadata (`gemma3.*` keys), read once at load into the [`LlamaConfig`] fields
//! the general forward pass uses (`layers`, `embed_scale`, `q_scale`, `ffn_act`): which layers
//! attend to a sliding window and with which RoPE base, the embedding and query scales, and
//! the GeGLU activation. Nothing here touches the KV cache: a sliding-window layer reads its
//! K/V through the same `SequenceKv::runs` as a global one and only skips the positions
//! outside its window.
//!
//! [`LlamaConfig`]: super::LlamaConfig

use gguf::GgufFile;

use super::{FfnAct, LayerAttention};
use crate::ModelError;

/// Gemma 3 settings beyond the llama block, read from `gemma3.*` metadata.
pub(crate) struct Gemma3 {
    pub layers: Vec<LayerAttention>,
    pub embed_scale: f32,
    pub q_scale: f32,
    pub ffn_act: FfnAct,
}

/// llama.cpp's pattern when the file names none: of every 6 layers, the first 5 are local
/// (sliding window) and the 6th global.
const DEFAULT_SWA_PATTERN: usize = 6;
/// llama.cpp's default `rope_freq_base_train_swa` (the key is absent from Google's files).
const DEFAULT_SWA_ROPE_BASE: f32 = 10_000.0;

pub(crate) struct Dims {
    pub n_layers: usize,
    pub dim: usize,
    pub n_heads: usize,
    pub head_dim: usize,
    pub rope_base: f32,
    pub rope_freq_scale: f32,
}

pub(crate) fn read(f: &GgufFile, d: &Dims) -> Result<Gemma3, ModelError> {
    let key = |k: &str| format!("gemma3.{k}");
    let opt_f = |k: &str| -> Result<Option<f64>, ModelError> {
        match f.get(&key(k)) {
            Some(_) => Ok(Some(f.get_f64(&key(k))?)),
            None => Ok(None),
        }
    };
    // Softcapping changes the logits (Gemma 2 has both; llama.cpp's Gemma 3 graph reads the
    // final one): refused rather than ignored, since no Gemma 3 file here carries it.
    for k in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if let Some(v) = opt_f(k)? {
            if v != 0.0 {
                return Err(ModelError::Unsupported(format!("gemma3.{k} = {v}")));
            }
        }
    }
    let window = match f.get(&key("attention.sliding_window")) {
        Some(_) => f.get_u64(&key("attention.sliding_window"))? as usize,
        None => 0,
    };
    let swa = if window == 0 {
        vec![false; d.n_layers]
    } else {
        swa_layers(f, d.n_layers)?
    };
    let swa_base = opt_f("rope.freq_base_swa")?.map_or(DEFAULT_SWA_ROPE_BASE, |v| v as f32);
    if !(swa_base.is_finite() && swa_base > 1.0) {
        return Err(ModelError::Unsupported(format!(
            "gemma3.rope.freq_base_swa = {swa_base}"
        )));
    }
    // Local layers keep their trained RoPE (llama.cpp's `rope_freq_scale_train_swa`, always
    // 1); only global layers take the file's linear scaling.
    let layers = swa
        .iter()
        .map(|&local| {
            if local {
                LayerAttention {
                    window: Some(window),
                    rope_base: swa_base,
                    rope_freq_scale: 1.0,
                }
            } else {
                LayerAttention {
                    window: None,
                    rope_base: d.rope_base,
                    rope_freq_scale: d.rope_freq_scale,
                }
            }
        })
        .collect();
    Ok(Gemma3 {
        layers,
        embed_scale: (d.dim as f32).sqrt(),
        q_scale: query_scale(d),
        ffn_act: FfnAct::GeluTanh,
    })
}

/// The factor llama.cpp applies to Q before attention (then scaling scores by 1). Google's
/// `query_pre_attn_scalar` is the head width in every size but 27B, where it is
/// `dim / heads`; llama.cpp recognizes 27B by its 62 layers, and so does this.
fn query_scale(d: &Dims) -> f32 {
    const LAYERS_27B: usize = 62;
    let width = if d.n_layers == LAYERS_27B {
        d.dim / d.n_heads
    } else {
        d.head_dim
    };
    1.0 / (width as f32).sqrt()
}

/// Which layers use the sliding window: `attention.sliding_window_pattern` as a per-layer
/// list of booleans, or as a period `n` (layer `i` is local unless `i % n == n - 1`; 0 makes
/// every layer local), 6 when absent.
fn swa_layers(f: &GgufFile, n_layers: usize) -> Result<Vec<bool>, ModelError> {
    let k = "gemma3.attention.sliding_window_pattern";
    let n = match f.get(k) {
        None => DEFAULT_SWA_PATTERN,
        Some(v) if v.as_u64().is_some() => f.get_u64(k)? as usize,
        Some(_) => {
            let arr = f.get_array(k)?;
            let flags: Option<Vec<bool>> = arr.iter().map(|v| v.as_bool()).collect();
            return match flags {
                Some(flags) if flags.len() == n_layers => Ok(flags),
                _ => Err(ModelError::Unsupported(format!(
                    "{k}: expected {n_layers} booleans or a number"
                ))),
            };
        }
    };
    Ok((0..n_layers).map(|i| n == 0 || i % n < n - 1).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_scale_follows_llama_cpp() {
        let d = |n_layers| Dims {
            n_layers,
            dim: 5376,
            n_heads: 32,
            head_dim: 128,
            rope_base: 1e6,
            rope_freq_scale: 1.0,
        };
        assert_eq!(query_scale(&d(18)), 1.0 / 128f32.sqrt());
        assert_eq!(query_scale(&d(62)), 1.0 / 168f32.sqrt());
    }
}
