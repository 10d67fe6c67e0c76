//! Q8_0 (`x = q * d`, 32 signed bytes and an f16 scale a block) against Q8_1
//! activations: one float step per block (`kernels/block_chain.rs`).

use gguf::GgmlType;
use half::f16;

use super::QuantFormat;
use crate::blocks::{Acts, BlockQ8_0, BlockQ8_1, LanesQ8_1, QK};
use crate::kernels::block_chain;

pub struct Q8_0;

impl QuantFormat for Q8_0 {
    const TYPE: GgmlType = GgmlType::Q8_0;
    type Block = BlockQ8_0;
    type Act = BlockQ8_1;

    /// The f16 scale widened to f32 (exact), so the kernels do no per-block conversion.
    fn load(ty: GgmlType, bytes: &[u8]) -> Vec<BlockQ8_0> {
        bytes
            .chunks_exact(ty.block_bytes())
            .map(|b| {
                let mut qs = [0i8; 32];
                for (q, &v) in qs.iter_mut().zip(&b[2..34]) {
                    *q = v as i8;
                }
                BlockQ8_0 {
                    d: f16::from_le_bytes([b[0], b[1]]).to_f32(),
                    qs,
                }
            })
            .collect()
    }

    fn dequantize(w: &[BlockQ8_0], out: &mut [f32]) {
        for (b, o) in w.iter().zip(out.chunks_exact_mut(QK)) {
            for (v, &q) in o.iter_mut().zip(&b.qs) {
                *v = q as f32 * b.d;
            }
        }
    }

    fn dot(w: &[BlockQ8_0], a: &[BlockQ8_1]) -> f32 {
        block_chain::chain_dot(w, a)
    }

    fn product(w: &[BlockQ8_0], nb: usize, acts: &Acts<'_>, n: usize, out: &mut [f32]) {
        block_chain::chain_rows(w, nb, acts.q8_1, n, out);
    }

    fn wants_block_lanes(n: usize) -> bool {
        block_chain::wants_lanes(n)
    }

    fn block_lanes_rows(
        w: &[BlockQ8_0],
        nb: usize,
        lanes: &[LanesQ8_1],
        n: usize,
        out: &mut [f32],
        ld: Option<usize>,
    ) -> bool {
        block_chain::lanes_rows(w, nb, lanes, n, out, ld)
    }
}
