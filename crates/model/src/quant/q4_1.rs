//! Q4_1 (`x = q * d + m`, 32 four-bit values, an f16 scale and minimum a block) against Q8_1
//! activations; the kernels are `kernels/quant_dot.rs`'s.

use gguf::GgmlType;
use half::f16;

use super::QuantFormat;
use crate::blocks::{Acts, BlockQ4_1, BlockQ8_1, QK};
use crate::kernels::{dot_q4_1, q4_1_product, q4_1_token_major};

pub struct Q4_1;

impl QuantFormat for Q4_1 {
    const TYPE: GgmlType = GgmlType::Q4_1;
    type Block = BlockQ4_1;
    type Act = BlockQ8_1;
    /// The 256-bit kernel scales a whole tile's four tokens with one vector multiply.
    const TILE_SCALES: bool = true;

    /// The f16 scale and minimum widened to f32 (exact).
    fn load(ty: GgmlType, bytes: &[u8]) -> Vec<BlockQ4_1> {
        bytes
            .chunks_exact(ty.block_bytes())
            .map(|b| {
                let mut qs = [0u8; 16];
                qs.copy_from_slice(&b[4..20]);
                BlockQ4_1 {
                    d: f16::from_le_bytes([b[0], b[1]]).to_f32(),
                    m: f16::from_le_bytes([b[2], b[3]]).to_f32(),
                    qs,
                }
            })
            .collect()
    }

    fn dequantize(w: &[BlockQ4_1], out: &mut [f32]) {
        for (b, o) in w.iter().zip(out.chunks_exact_mut(QK)) {
            for j in 0..16 {
                o[j] = (b.qs[j] & 15) as f32 * b.d + b.m;
                o[j + 16] = (b.qs[j] >> 4) as f32 * b.d + b.m;
            }
        }
    }

    fn dot(w: &[BlockQ4_1], a: &[BlockQ8_1]) -> f32 {
        let mut out = [0f32];
        dot_q4_1(w, &[a], None, &mut out);
        out[0]
    }

    fn dot_tile(w: &[BlockQ4_1], acts: &[&[BlockQ8_1]], out: &mut [f32]) {
        dot_q4_1(w, acts, None, out);
    }

    fn product(w: &[BlockQ4_1], nb: usize, acts: &Acts<'_>, n: usize, out: &mut [f32]) {
        q4_1_product(w, nb, acts.q8_1, acts.tile_scales, n, out);
    }

    fn rows_token_major(
        w: &[BlockQ4_1],
        nb: usize,
        x: &[BlockQ8_1],
        n: usize,
        out: &mut [f32],
        ld: usize,
    ) -> bool {
        q4_1_token_major(w, nb, x, n, out, ld)
    }
}
