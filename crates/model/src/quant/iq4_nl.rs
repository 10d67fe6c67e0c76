//! IQ4_NL (32 elements a block: an f16 scale and 16 bytes of nibbles indexing the fixed
//! table `gguf::KVALUES_IQ4NL`) against Q8_1 activations, kept as ggml's bytes. llama.cpp
//! pairs it with Q8_0, whose AVX2 `d` and `qs` are our Q8_1's. Portable only: compiled for
//! AVX2/FMA by the default product, the multiply-adds are single instructions.

use gguf::{GgmlType, KVALUES_IQ4NL};

use super::{byte_blocks, byte_view, QuantFormat};
use crate::blocks::{f16_at, hsum8, BlockQ8_1};

/// Bytes of one block.
const BYTES: usize = 18;

pub struct IQ4NL;

/// Element `e` of the block `wb`: its nibble's table value.
#[inline(always)]
fn value(wb: &[u8], e: usize) -> i32 {
    let q = if e < 16 {
        wb[2 + e] & 0x0f
    } else {
        wb[2 + e - 16] >> 4
    };
    i32::from(KVALUES_IQ4NL[usize::from(q)])
}

/// The eight lane sums of one block as llama.cpp's AVX2 kernel forms them (lane `i` holds
/// elements `4i..4i + 4`); exact integers.
#[inline(always)]
fn lanes(wb: &[u8], ab: &BlockQ8_1) -> [i32; 8] {
    std::array::from_fn(|i| {
        (4 * i..4 * i + 4)
            .map(|e| value(wb, e) * i32::from(ab.qs[e]))
            .sum()
    })
}

impl IQ4NL {
    /// In llama.cpp's AVX2 float order (`ggml_vec_dot_iq4_nl_q8_0`): blocks two at a time,
    /// the even ones into one set of eight lane accumulators and the odd ones into another,
    /// each by a fused multiply-add with `d_a·d_w`; the two sets added lane by lane and
    /// summed as its `hsum_float_8`; an odd last block added after, as one scaled sum.
    #[inline(always)]
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8_1]) -> f32 {
        let nb = a.len().min(w.len() / BYTES);
        let pairs = nb / 2 * 2;
        let mut acc = [[0f32; 8]; 2];
        for (i, (wb, ab)) in w.chunks_exact(BYTES).zip(a).take(pairs).enumerate() {
            let d = ab.d * f16_at(wb, 0);
            for (acc, lane) in acc[i % 2].iter_mut().zip(lanes(wb, ab)) {
                *acc = d.mul_add(lane as f32, *acc);
            }
        }
        let mut sum = hsum8(std::array::from_fn(|l| acc[0][l] + acc[1][l]));
        if nb > pairs {
            let (wb, ab) = (&w[pairs * BYTES..nb * BYTES], &a[pairs]);
            let d = ab.d * f16_at(wb, 0);
            let sumi: i32 = (0..32).map(|e| value(wb, e) * i32::from(ab.qs[e])).sum();
            sum = d.mul_add(sumi as f32, sum);
        }
        sum
    }
}

impl QuantFormat for IQ4NL {
    const TYPE: GgmlType = GgmlType::IQ4_NL;
    type Block = [u8; BYTES];
    type Act = BlockQ8_1;

    fn load(_: GgmlType, bytes: &[u8]) -> Vec<[u8; BYTES]> {
        byte_blocks(bytes)
    }

    fn view(bytes: &[u8]) -> Option<&[[u8; BYTES]]> {
        Some(byte_view(bytes))
    }

    fn dequantize(w: &[[u8; BYTES]], out: &mut [f32]) {
        Self::TYPE.dequantize(w.as_flattened(), out);
    }

    #[inline(always)]
    fn dot(w: &[[u8; BYTES]], a: &[BlockQ8_1]) -> f32 {
        Self::dot_scalar(w.as_flattened(), a)
    }
}
