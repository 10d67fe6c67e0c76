//! Q4_0 (`x = (q - 8) * d`, 32 four-bit values and an f16 scale a block) against Q8_1
//! activations: one float step per block (`kernels/block_chain.rs`).

use gguf::GgmlType;
use half::f16;

use super::QuantFormat;
use crate::blocks::{Acts, BlockQ4_0, BlockQ8_1, LanesQ8_1, QK};
use crate::kernels::block_chain;

pub struct Q4_0;

impl QuantFormat for Q4_0 {
    const TYPE: GgmlType = GgmlType::Q4_0;
    type Block = BlockQ4_0;
    type Act = BlockQ8_1;

    /// The f16 scale widened to f32 (exact), so the kernels do no per-block conversion.
    fn load(ty: GgmlType, bytes: &[u8]) -> Vec<BlockQ4_0> {
        bytes
            .chunks_exact(ty.block_bytes())
            .map(|b| {
                let mut qs = [0u8; 16];
                qs.copy_from_slice(&b[2..18]);
                BlockQ4_0 {
                    d: f16::from_le_bytes([b[0], b[1]]).to_f32(),
                    qs,
                }
            })
            .collect()
    }

    fn dequantize(w: &[BlockQ4_0], out: &mut [f32]) {
        for (b, o) in w.iter().zip(out.chunks_exact_mut(QK)) {
            for j in 0..16 {
                o[j] = ((b.qs[j] & 15) as i32 - 8) as f32 * b.d;
                o[j + 16] = ((b.qs[j] >> 4) as i32 - 8) as f32 * b.d;
            }
        }
    }

    fn dot(w: &[BlockQ4_0], a: &[BlockQ8_1]) -> f32 {
        block_chain::chain_dot(w, a)
    }

    fn product(w: &[BlockQ4_0], nb: usize, acts: &Acts<'_>, n: usize, out: &mut [f32]) {
        block_chain::chain_rows(w, nb, acts.q8_1, n, out);
    }

    fn wants_block_lanes(n: usize) -> bool {
        block_chain::wants_lanes(n)
    }

    fn block_lanes_rows(
        w: &[BlockQ4_0],
        nb: usize,
        lanes: &[LanesQ8_1],
        n: usize,
        out: &mut [f32],
        ld: Option<usize>,
    ) -> bool {
        block_chain::lanes_rows(w, nb, lanes, n, out, ld)
    }
}
