//! Rotary position embedding: each batch row's angles, computed as ggml does, and their
//! application to Q and K rows.

use crate::config::LayerAttention;
use crate::LlamaConfig;

/// Rotary embedding angles per batch row, computed as ggml does: `theta_i = pos *
/// base^(-2i/d)` built by repeated multiplication, divided by the pair's frequency factor
/// (Llama 3) and multiplied by the linear scale. The pairs are adjacent dimensions (llama's
/// NORMAL mode) or dimension `i` with `i + d/2` (NEOX mode, the Qwen families).
pub(super) struct RopeTable {
    half: usize,
    neox: bool,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    pub(super) fn new(
        c: &LlamaConfig,
        layer: &LayerAttention,
        freqs: Option<&[f32]>,
        positions: impl Iterator<Item = usize>,
    ) -> Self {
        let half = c.rope_dims / 2;
        let theta_scale = layer.rope_base.powf(-2.0 / c.rope_dims as f32);
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        for p in positions {
            let mut theta = p as f32;
            for i in 0..half {
                // With no factors and no scaling both operations are exact (x / 1, 1 * x),
                // so llama's original path keeps its bits.
                let ff = freqs.map_or(1.0, |f| f[i]);
                let t = layer.rope_freq_scale * (theta / ff);
                cos.push(t.cos());
                sin.push(t.sin());
                theta *= theta_scale;
            }
        }
        Self {
            half,
            neox: c.arch.rope_neox(),
            cos,
            sin,
        }
    }

    pub(super) fn apply(&self, row: usize, x: &mut [f32], hd: usize) {
        let cs = &self.cos[row * self.half..(row + 1) * self.half];
        let sn = &self.sin[row * self.half..(row + 1) * self.half];
        crate::kernels::rope_row(x, hd, cs, sn, self.neox);
    }
}
