//! Q5_0 and Q5_1 (32 five-bit values a block: an f16 scale, Q5_1 also an f16 minimum, 4
//! bytes of fifth bits, 16 of nibbles) against Q8_1 activations, kept as ggml's bytes.
//! Q5_0 has one float step per block (`kernels/block_chain.rs`); Q5_1 keeps llama.cpp's
//! AVX2 float order, with the AVX2 tile (`kernels/avx2_kquants.rs`) and the 512-bit register
//! tiles (`kernels/x86_512.rs`).

use gguf::GgmlType;

use super::{byte_blocks, byte_view, QuantFormat};
#[cfg(target_arch = "x86_64")]
use crate::blocks::TILE;
use crate::blocks::{f16_at, hsum8, Acts, BlockQ8_1, LanesQ8_1};
use crate::kernels::block_chain;
#[cfg(target_arch = "x86_64")]
use crate::kernels::{avx2_kquants as simd, cpu, x86_512};

/// The 32 five-bit values of a Q5_1 block from its `qh` (4 bytes) and `qs` (16).
fn five_bit(qh: &[u8], qs: &[u8]) -> [i32; 32] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut q = [0i32; 32];
    for j in 0..16 {
        q[j] = i32::from(qs[j] & 0x0f) | (((qh >> j) & 1) << 4) as i32;
        q[j + 16] = i32::from(qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4) as i32;
    }
    q
}

fn isum(q: &[i32], a: &[i8]) -> i32 {
    q.iter().zip(a).map(|(&x, &y)| x * i32::from(y)).sum()
}

#[allow(non_camel_case_types)]
pub struct Q5_0;

impl Q5_0 {
    /// One float step per block (`kernels/block_chain.rs`). The portable definition (the
    /// SIMD paths are tested against it).
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8_1]) -> f32 {
        block_chain::chain_dot_portable(byte_view::<22>(w), a)
    }
}

impl QuantFormat for Q5_0 {
    const TYPE: GgmlType = GgmlType::Q5_0;
    type Block = [u8; 22];
    type Act = BlockQ8_1;

    fn load(_: GgmlType, bytes: &[u8]) -> Vec<[u8; 22]> {
        byte_blocks(bytes)
    }

    fn view(bytes: &[u8]) -> Option<&[[u8; 22]]> {
        Some(byte_view(bytes))
    }

    fn dequantize(w: &[[u8; 22]], out: &mut [f32]) {
        Self::TYPE.dequantize(w.as_flattened(), out);
    }

    fn dot(w: &[[u8; 22]], a: &[BlockQ8_1]) -> f32 {
        block_chain::chain_dot(w, a)
    }

    fn product(w: &[[u8; 22]], nb: usize, acts: &Acts<'_>, n: usize, out: &mut [f32]) {
        block_chain::chain_rows(w, nb, acts.q8_1, n, out);
    }

    fn wants_block_lanes(n: usize) -> bool {
        block_chain::wants_lanes(n)
    }

    fn block_lanes_rows(
        w: &[[u8; 22]],
        nb: usize,
        lanes: &[LanesQ8_1],
        n: usize,
        out: &mut [f32],
        ld: Option<usize>,
    ) -> bool {
        block_chain::lanes_rows(w, nb, lanes, n, out, ld)
    }
}

#[allow(non_camel_case_types)]
pub struct Q5_1;

impl Q5_1 {
    /// In llama.cpp's AVX2 float order (`ggml_vec_dot_q5_1_q8_1`, built with contracted
    /// multiply-adds): eight lanes of four products per block, each added by a fused
    /// multiply-add with `d·da`; the offsets `m·s` summed apart and added last.
    /// The portable definition (the SIMD path is tested against it).
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8_1]) -> f32 {
        let mut acc = [0f32; 8];
        let mut summs = 0f32;
        for (wb, ab) in w.chunks_exact(24).zip(a) {
            summs = f16_at(wb, 2).mul_add(ab.s, summs);
            let q = five_bit(&wb[4..8], &wb[8..24]);
            let d = f16_at(wb, 0) * ab.d;
            for (i, acc) in acc.iter_mut().enumerate() {
                let lane = isum(&q[4 * i..4 * i + 4], &ab.qs[4 * i..4 * i + 4]);
                *acc = (lane as f32).mul_add(d, *acc);
            }
        }
        hsum8(acc) + summs
    }
}

impl QuantFormat for Q5_1 {
    const TYPE: GgmlType = GgmlType::Q5_1;
    type Block = [u8; 24];
    type Act = BlockQ8_1;

    fn load(_: GgmlType, bytes: &[u8]) -> Vec<[u8; 24]> {
        byte_blocks(bytes)
    }

    fn view(bytes: &[u8]) -> Option<&[[u8; 24]]> {
        Some(byte_view(bytes))
    }

    fn dequantize(w: &[[u8; 24]], out: &mut [f32]) {
        Self::TYPE.dequantize(w.as_flattened(), out);
    }

    #[inline(always)]
    fn dot(w: &[[u8; 24]], a: &[BlockQ8_1]) -> f32 {
        let mut out = [0f32];
        Self::dot_tile(w, &[a], &mut out);
        out[0]
    }

    /// Per block the five-bit values are unpacked once for the tile; each token's lanes
    /// then follow [`Q5_1::dot_scalar`] exactly: the SIMD rows where the CPU has them, else
    /// the portable definition token by token.
    #[inline(always)]
    fn dot_tile(w: &[[u8; 24]], acts: &[&[BlockQ8_1]], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if cpu::avx2_fma_f16c_detected() && !acts.is_empty() {
            // SAFETY: AVX2, FMA and F16C are present (checked above); the function checks
            // the slice lengths it reads.
            unsafe { simd::q5_1_rows(w.as_flattened(), acts, out) };
            return;
        }
        for (a, o) in acts.iter().zip(out.iter_mut()) {
            *o = Self::dot_scalar(w.as_flattened(), a);
        }
    }

    /// The whole tiles of tokens through the 512-bit register tiles where the CPU has them;
    /// returns the tokens done.
    #[inline(always)]
    fn wide_rows(w: &[[u8; 24]], nb: usize, x: &[BlockQ8_1], n: usize, out: &mut [f32]) -> usize {
        #[cfg(target_arch = "x86_64")]
        if n >= TILE && cpu::wide_available() && cpu::avx2_fma_f16c_detected() {
            // SAFETY: the CPU has the features `wide_available` checks (AVX-512 F, BW, DQ,
            // VL, VNNI, with AVX2 and FMA) and F16C, the function's only requirement; it
            // bounds-checks its slices.
            return unsafe { x86_512::row_major_tiles(w, nb, x, n, out) };
        }
        let _ = (w, nb, x, n, out);
        0
    }

    /// Straight into token-major `out` (`out[t * ld + r]`), where the CPU has the 512-bit
    /// tiles and `n` is whole tiles; false (nothing done) where not.
    #[inline(always)]
    fn rows_token_major(
        w: &[[u8; 24]],
        nb: usize,
        x: &[BlockQ8_1],
        n: usize,
        out: &mut [f32],
        ld: usize,
    ) -> bool {
        #[cfg(target_arch = "x86_64")]
        if cpu::wide_available() {
            // SAFETY: the CPU has the features `wide_available` checks, the function's only
            // requirement; it bounds-checks its slices.
            return unsafe { x86_512::token_major(w, nb, x, n, out, ld) };
        }
        let _ = (w, nb, x, n, out, ld);
        false
    }
}
