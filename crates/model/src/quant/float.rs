//! Unquantized weights (GGUF F32, F16 and BF16 tensors, widened to f32 at load) against f32
//! activations.

use gguf::GgmlType;

use super::QuantFormat;
use crate::blocks::Acts;
use crate::kernels::dot_f32;

/// f32 weights: one element a block, the input taken unquantized.
pub struct F32;

impl QuantFormat for F32 {
    const TYPE: GgmlType = GgmlType::F32;
    type Block = f32;
    type Act = f32;

    fn load(ty: GgmlType, bytes: &[u8]) -> Vec<f32> {
        let mut out = vec![0f32; bytes.len() / ty.block_bytes()];
        ty.dequantize(bytes, &mut out);
        out
    }

    fn dequantize(w: &[f32], out: &mut [f32]) {
        out.copy_from_slice(w);
    }

    fn dot(w: &[f32], a: &[f32]) -> f32 {
        dot_f32(w, a)
    }

    /// Row by row, token by token, as built (no SIMD-compiled wrapper).
    fn product(w: &[f32], nb: usize, acts: &Acts<'_>, n: usize, out: &mut [f32]) {
        let x = acts.f32;
        for (r, wr) in w.chunks_exact(nb).enumerate() {
            for t in 0..n {
                out[r * n + t] = dot_f32(wr, &x[t * nb..(t + 1) * nb]);
            }
        }
    }
}
