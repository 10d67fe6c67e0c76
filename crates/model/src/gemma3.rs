//! Gemma 3 (`general.architecture = "gemma3"`), as llama.cpp's `src/models/gemma3.cpp` builds
//! it: the llama block with per-head Q/K RMSNorms, an RMSNorm after attention and after the
//! feed-forward (before each residual add), GeGLU instead of SwiGLU, embeddings scaled by
//! `sqrt(dim)`, and layers that attend only to a sliding window of recent positions, with
//! their own RoPE base, between global layers.
//!
//! What this file decides is read once at load into [`LlamaConfig`] fields that the general
//! forward pass uses (`layers`, `embed_scale`, `q_scale`, `ffn_act`); nothing here touches the
//! KV cache. A sliding-window layer reads its K/V through the same `SequenceKv::runs` as a
//! global one and only skips the positions outside its window.

use gguf::GgufFile;
use half::f16;

use crate::config::{FfnAct, LayerAttention};
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

/// ggml's GELU with the tanh approximation, as its CPU GeGLU computes it: the input rounded
/// to f16 and looked up in a table of f16 results (`ggml_table_gelu_f16`, each entry the
/// f32 formula on that f16 value), except at or beyond ±10 where it is 0 or the input.
pub fn gelu_tanh(x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        gelu_table()[usize::from(f16::from_f32(x).to_bits())]
    }
}

/// Every f16's GELU, rounded to f16 (as f32), built on first use as ggml builds its table:
/// computing `tanh` per element instead was a fifth of a Gemma 3 prefill.
fn gelu_table() -> &'static [f32] {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| gelu_f16_value(f16::from_bits(bits).to_f32()))
            .collect()
    })
}

/// The table's entry for the f16 value `h`.
fn gelu_f16_value(h: f32) -> f32 {
    f16::from_f32(gelu_f32(h)).to_f32()
}

/// `0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))` in f32, with the one contraction GCC
/// makes of ggml's expression (`1 + (a x) x` fused).
fn gelu_f32(x: f32) -> f32 {
    const GELU_COEF_A: f32 = 0.044715;
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let inner = (GELU_COEF_A * x).mul_add(x, 1.0);
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * inner).tanh())
}

/// `gate[i] = gelu_tanh(gate[i]) * up[i]` (ggml's `geglu_split`).
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    crate::kernels::table_glu(gate, up, gelu_table(), gelu_tanh);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector GeGLU (one conversion and a gather per eight lanes) against the scalar
    /// definition on every f16 value, the saturation edges and values between f16s.
    #[test]
    fn vector_geglu_matches_the_scalar_definition() {
        let mut gate: Vec<f32> = (0..=u16::MAX).map(|b| f16::from_bits(b).to_f32()).collect();
        gate.extend([
            -10.0, 10.0, -10.001, 10.001, 9.999, -9.999, 0.1234567, -3.3333333,
        ]);
        gate.extend((0..1000).map(|i| (i as f32 - 500.0) * 0.0213));
        let up: Vec<f32> = (0..gate.len())
            .map(|i| 1.0 + (i % 7) as f32 * 0.25)
            .collect();
        let want: Vec<f32> = gate
            .iter()
            .zip(&up)
            .map(|(&g, u)| gelu_tanh(g) * u)
            .collect();
        geglu(&mut gate, &up);
        for (i, (got, want)) in gate.iter().zip(&want).enumerate() {
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "element {i}: {got} against {want}"
            );
        }
    }

    #[test]
    fn gelu_matches_the_formula_to_f16_precision_and_saturates() {
        for i in -400..400 {
            let x = i as f32 * 0.025;
            let exact = 0.5
                * x as f64
                * (1.0
                    + ((2.0 / std::f64::consts::PI).sqrt()
                        * (x as f64 + 0.044715 * (x as f64).powi(3)))
                    .tanh());
            let got = gelu_tanh(x) as f64;
            // Two f16 roundings (input and output): within a few parts in a thousand.
            assert!(
                (got - exact).abs() <= 4e-3 * exact.abs().max(1.0),
                "gelu({x}) = {got}, formula {exact}"
            );
        }
        assert_eq!(gelu_tanh(-10.0), 0.0);
        assert_eq!(gelu_tanh(12.5), 12.5);
        // The table works on the f16 value: inputs that round to the same f16 agree.
        assert_eq!(gelu_tanh(1.0), gelu_tanh(1.0 + 1e-4));
        // Each lookup is the formula on the input's f16 value, rounded to f16.
        for i in -100_000..100_000 {
            let x = i as f32 * 9.99e-5;
            let direct = gelu_f16_value(f16::from_f32(x).to_f32());
            assert_eq!(gelu_tanh(x).to_bits(), direct.to_bits(), "gelu({x})");
        }
    }

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
