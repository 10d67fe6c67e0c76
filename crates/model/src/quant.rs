//! Weight formats added after the original three (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): one
//! [`QuantFormat`] implementation per ggml type, each defining its dot product against the
//! activation quantization ggml pairs it with (Q8_1 blocks of 32, or Q8_K super-blocks of
//! 256). Matrices keep ggml's bytes as they are in the file.
//!
//! The kernels compute exact integer sums per (sub-)block, then apply the block's float
//! scales in a fixed order. Q4_K, Q5_K and Q6_K have AVX2 builds of the integer part (run-time
//! dispatch, as in `kernels.rs`); integer sums do not depend on their order, so the SIMD
//! and portable paths give the same bits. That float order is not yet llama.cpp's AVX2
//! order, so greedy output on these types is not claimed to match llama.cpp bit for bit
//! (unlike the Q4_0/Q4_1/Q8_0 kernels in `kernels.rs`).

use std::marker::PhantomData;

use gguf::{GgmlType, QK_K};
use half::f16;

use crate::weights::{BlockQ8_1, QK};

/// An activation super-block quantized as ggml's Q8_K: `x ≈ d * q`, with the sum of each
/// 16 quants kept for the k-quants' offset terms.
#[derive(Clone, Copy, Debug)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

impl Default for BlockQ8K {
    fn default() -> Self {
        Self {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        }
    }
}

/// Quantizes one activation row (length a multiple of 256) as ggml's reference Q8_K does:
/// the scale comes from the signed value of largest magnitude (`-127 / max`), values round
/// to nearest even and are capped at 127.
pub fn quantize_row_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    for (blk, o) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let mut max = 0f32;
        let mut amax = 0f32;
        for &v in blk {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *o = BlockQ8K::default();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in o.qs.iter_mut().zip(blk) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        for (s, group) in o.bsums.iter_mut().zip(o.qs.chunks_exact(16)) {
            *s = group.iter().map(|&q| i16::from(q)).sum();
        }
        o.d = 1.0 / iscale;
    }
}

/// Every activation quantization of the same input rows; a format takes the one it needs.
pub struct Acts<'a> {
    pub q8_1: &'a [BlockQ8_1],
    pub q8_k: &'a [BlockQ8K],
}

/// An activation block type: how many elements a block covers, and where to find it.
pub trait ActBlock: Sized + 'static {
    const ELEMS: usize;
    fn pick<'a>(acts: &Acts<'a>) -> &'a [Self];
}

impl ActBlock for BlockQ8_1 {
    const ELEMS: usize = QK;
    fn pick<'a>(acts: &Acts<'a>) -> &'a [Self] {
        acts.q8_1
    }
}

impl ActBlock for BlockQ8K {
    const ELEMS: usize = QK_K;
    fn pick<'a>(acts: &Acts<'a>) -> &'a [Self] {
        acts.q8_k
    }
}

/// One ggml weight format the kernels can multiply.
pub trait QuantFormat: Send + Sync + 'static {
    const TYPE: GgmlType;
    /// The activation blocks the dot product takes.
    type Act: ActBlock;
    /// One weight row (ggml's blocks, as bytes) against one activation row.
    fn dot(w: &[u8], a: &[Self::Act]) -> f32;
    /// One weight row against up to [`TILE`] activation rows, `out[t]` exactly
    /// `dot(w, acts[t])`; formats whose unpacking dominates share it across the tile.
    fn dot_tile(w: &[u8], acts: &[&[Self::Act]], out: &mut [f32]) {
        for (a, o) in acts.iter().zip(out.iter_mut()) {
            *o = Self::dot(w, a);
        }
    }
}

/// Activation rows a weight row is unpacked once for.
pub const TILE: usize = 4;

/// The tile's activation rows as exactly [`TILE`] references, the last repeated to fill it
/// (the SIMD tile kernels take a fixed count; results past `acts.len()` are discarded).
#[cfg(target_arch = "x86_64")]
fn padded<A>(acts: &[&[A]]) -> [usize; TILE] {
    std::array::from_fn(|t| t.min(acts.len().saturating_sub(1)))
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// The 32 five-bit values of a Q5_0/Q5_1 block from its `qh` (4 bytes) and `qs` (16).
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
    /// The portable definition (the SIMD path is tested against it).
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8_1]) -> f32 {
        let mut acc = 0f32;
        for (wb, ab) in w.chunks_exact(22).zip(a) {
            let mut q = five_bit(&wb[2..6], &wb[6..22]);
            q.iter_mut().for_each(|v| *v -= 16);
            acc += f16_at(wb, 0) * ab.d * isum(&q, &ab.qs) as f32;
        }
        acc
    }
}

impl QuantFormat for Q5_0 {
    const TYPE: GgmlType = GgmlType::Q5_0;
    type Act = BlockQ8_1;

    fn dot(w: &[u8], a: &[BlockQ8_1]) -> f32 {
        let mut out = [0f32];
        Self::dot_tile(w, &[a], &mut out);
        out[0]
    }

    /// Per block the five-bit values are unpacked once for the tile; each token gets the
    /// scalar definition's float expression on its exact integer sum, so its bits.
    fn dot_tile(w: &[u8], acts: &[&[BlockQ8_1]], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if simd::has_avx2_f16c() && !acts.is_empty() {
            // SAFETY: AVX2 and F16C are present (checked above); the function checks the
            // slice lengths it reads.
            unsafe { simd::five_bit_rows(w, acts, false, out) };
            return;
        }
        for (a, o) in acts.iter().zip(out.iter_mut()) {
            *o = Self::dot_scalar(w, a);
        }
    }
}

#[allow(non_camel_case_types)]
pub struct Q5_1;

impl Q5_1 {
    /// The portable definition (the SIMD path is tested against it).
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8_1]) -> f32 {
        let mut acc = 0f32;
        for (wb, ab) in w.chunks_exact(24).zip(a) {
            let q = five_bit(&wb[4..8], &wb[8..24]);
            acc += f16_at(wb, 0) * ab.d * isum(&q, &ab.qs) as f32 + f16_at(wb, 2) * ab.s;
        }
        acc
    }
}

impl QuantFormat for Q5_1 {
    const TYPE: GgmlType = GgmlType::Q5_1;
    type Act = BlockQ8_1;

    fn dot(w: &[u8], a: &[BlockQ8_1]) -> f32 {
        let mut out = [0f32];
        Self::dot_tile(w, &[a], &mut out);
        out[0]
    }

    /// As [`Q5_0`]'s.
    fn dot_tile(w: &[u8], acts: &[&[BlockQ8_1]], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if simd::has_avx2_f16c() && !acts.is_empty() {
            // SAFETY: AVX2 and F16C are present (checked above); the function checks the
            // slice lengths it reads.
            unsafe { simd::five_bit_rows(w, acts, true, out) };
            return;
        }
        for (a, o) in acts.iter().zip(out.iter_mut()) {
            *o = Self::dot_scalar(w, a);
        }
    }
}

/// Q4_K and Q5_K: eight sub-blocks of 32 with 6-bit scales and mins;
/// `Σ x·a = d·da·Σ_j sc_j Σ q·a − dmin·da·Σ_j m_j Σ a`, the last sums from `bsums`.
fn dot_k4_like(w: &[u8], a: &[BlockQ8K], bytes: usize, value: impl Fn(&[u8], usize) -> i32) -> f32 {
    let mut acc = 0f32;
    for (wb, ab) in w.chunks_exact(bytes).zip(a) {
        let scales = &wb[4..16];
        let mut sumi = 0i32;
        let mut summ = 0i32;
        for j in 0..8 {
            let (sc, m) = gguf::k4_scale_min(j, scales);
            let mut s = 0i32;
            for l in 0..32 {
                s += value(wb, 32 * j + l) * i32::from(ab.qs[32 * j + l]);
            }
            sumi += i32::from(sc) * s;
            summ += i32::from(m) * (i32::from(ab.bsums[2 * j]) + i32::from(ab.bsums[2 * j + 1]));
        }
        acc += f16_at(wb, 0) * ab.d * sumi as f32 - f16_at(wb, 2) * ab.d * summ as f32;
    }
    acc
}

pub struct Q4K;

impl Q4K {
    /// The portable definition (the SIMD path is tested against it).
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
        dot_k4_like(w, a, 144, |b, e| {
            let (j, l) = (e / 32, e % 32);
            let q = b[16 + 32 * (j / 2) + l];
            i32::from(if j % 2 == 0 { q & 0x0f } else { q >> 4 })
        })
    }
}

impl QuantFormat for Q4K {
    const TYPE: GgmlType = GgmlType::Q4_K;
    type Act = BlockQ8K;

    fn dot_tile(w: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if simd::has_avx2() && acts.len() > 1 {
            k4_tile(w, acts, out, 144, |wb, a, sc| {
                // SAFETY: AVX2 is present (checked above); the function checks the slice
                // lengths it reads.
                unsafe { simd::q4_k_sumi_tile(&wb[16..144], a, sc) }
            });
            return;
        }
        for (a, o) in acts.iter().zip(out.iter_mut()) {
            *o = Self::dot(w, a);
        }
    }

    fn dot(w: &[u8], a: &[BlockQ8K]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if simd::has_avx2() {
            let mut acc = 0f32;
            for (wb, ab) in w.chunks_exact(144).zip(a) {
                let (sc, summ) = k4_scales(wb, ab);
                // SAFETY: AVX2 is present (checked above), the only requirement of the
                // target-feature function; it checks the slice lengths it reads.
                let sumi = unsafe { simd::q4_k_sumi(&wb[16..144], &ab.qs, &sc) };
                // The same float expression as `dot_k4_like`, on the same integers.
                acc += f16_at(wb, 0) * ab.d * sumi as f32 - f16_at(wb, 2) * ab.d * summ as f32;
            }
            return acc;
        }
        Self::dot_scalar(w, a)
    }
}

/// The eight 6-bit sub-block scales of a Q4_K/Q5_K block, and `Σ_j m_j Σ a` over its
/// sub-blocks (the offset term, from the activations' `bsums`).
#[cfg(target_arch = "x86_64")]
fn k4_scales(wb: &[u8], ab: &BlockQ8K) -> ([u8; 8], i32) {
    let mut sc = [0u8; 8];
    let mut summ = 0i32;
    for (j, s) in sc.iter_mut().enumerate() {
        let (scale, m) = gguf::k4_scale_min(j, &wb[4..16]);
        *s = scale;
        summ += i32::from(m) * (i32::from(ab.bsums[2 * j]) + i32::from(ab.bsums[2 * j + 1]));
    }
    (sc, summ)
}

/// [`QuantFormat::dot_tile`] for Q4_K and Q5_K: per super-block, the scales are decoded and
/// the quants unpacked once (`sumi` returns the tile's integer sums), then each token gets
/// `dot`'s own float expression on its own integers, so each result is `dot`'s bits.
#[cfg(target_arch = "x86_64")]
fn k4_tile(
    w: &[u8],
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
    bytes: usize,
    sumi: impl Fn(&[u8], [&[i8; QK_K]; TILE], &[u8; 8]) -> [i32; TILE],
) {
    let pick = padded(acts);
    let mut acc = [0f32; TILE];
    for (i, wb) in w.chunks_exact(bytes).enumerate() {
        let mut sc = [0u8; 8];
        let mut mins = [0u8; 8];
        for j in 0..8 {
            (sc[j], mins[j]) = gguf::k4_scale_min(j, &wb[4..16]);
        }
        let sums = sumi(wb, pick.map(|t| &acts[t][i].qs), &sc);
        for (t, a) in acts.iter().enumerate() {
            let ab = &a[i];
            let mut summ = 0i32;
            for (j, &m) in mins.iter().enumerate() {
                summ +=
                    i32::from(m) * (i32::from(ab.bsums[2 * j]) + i32::from(ab.bsums[2 * j + 1]));
            }
            // The same float expression as `dot_k4_like`, on the same integers.
            acc[t] += f16_at(wb, 0) * ab.d * sums[t] as f32 - f16_at(wb, 2) * ab.d * summ as f32;
        }
    }
    out[..acts.len()].copy_from_slice(&acc[..acts.len()]);
}

pub struct Q5K;

impl QuantFormat for Q5K {
    const TYPE: GgmlType = GgmlType::Q5_K;
    type Act = BlockQ8K;

    fn dot_tile(w: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if simd::has_avx2() && acts.len() > 1 {
            k4_tile(w, acts, out, 176, |wb, a, sc| {
                // SAFETY: AVX2 is present (checked above); the function checks the slice
                // lengths it reads.
                unsafe { simd::q5_k_sumi_tile(&wb[16..48], &wb[48..176], a, sc) }
            });
            return;
        }
        for (a, o) in acts.iter().zip(out.iter_mut()) {
            *o = Self::dot(w, a);
        }
    }

    fn dot(w: &[u8], a: &[BlockQ8K]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if simd::has_avx2() {
            let mut acc = 0f32;
            for (wb, ab) in w.chunks_exact(176).zip(a) {
                let (sc, summ) = k4_scales(wb, ab);
                // SAFETY: AVX2 is present (checked above), the only requirement of the
                // target-feature function; it checks the slice lengths it reads.
                let sumi = unsafe { simd::q5_k_sumi(&wb[16..48], &wb[48..176], &ab.qs, &sc) };
                // The same float expression as `dot_k4_like`, on the same integers.
                acc += f16_at(wb, 0) * ab.d * sumi as f32 - f16_at(wb, 2) * ab.d * summ as f32;
            }
            return acc;
        }
        Self::dot_scalar(w, a)
    }
}

impl Q5K {
    /// The portable definition (the SIMD path is tested against it).
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
        dot_k4_like(w, a, 176, |b, e| {
            let (j, l) = (e / 32, e % 32);
            let q = b[48 + 32 * (j / 2) + l];
            let lo = if j % 2 == 0 { q & 0x0f } else { q >> 4 };
            i32::from(lo | (((b[16 + l] >> j) & 1) << 4))
        })
    }
}

pub struct Q6K;

impl QuantFormat for Q6K {
    const TYPE: GgmlType = GgmlType::Q6_K;
    type Act = BlockQ8K;

    /// Per super-block the quants are unpacked once for the tile; each token then gets
    /// `dot`'s integers and float expression, so each result is `dot`'s bits.
    fn dot_tile(w: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if simd::has_avx2() && acts.len() > 1 {
            let pick = padded(acts);
            let mut acc = [0f32; TILE];
            for (i, wb) in w.chunks_exact(210).enumerate() {
                let mut sc = [0i8; 16];
                for (s, &b) in sc.iter_mut().zip(&wb[192..208]) {
                    *s = b as i8;
                }
                let a = pick.map(|t| &acts[t][i].qs);
                // SAFETY: AVX2 is present (checked above); the function checks the slice
                // lengths it reads.
                let unsigned = unsafe { simd::q6_k_sumi_tile(&wb[..128], &wb[128..192], a, &sc) };
                for (t, x) in acts.iter().enumerate() {
                    let ab = &x[i];
                    let offset: i32 = sc
                        .iter()
                        .zip(&ab.bsums)
                        .map(|(&s, &b)| i32::from(s) * i32::from(b))
                        .sum();
                    let sumi = unsigned[t] - 32 * offset;
                    acc[t] += f16_at(wb, 208) * ab.d * sumi as f32;
                }
            }
            out[..acts.len()].copy_from_slice(&acc[..acts.len()]);
            return;
        }
        for (a, o) in acts.iter().zip(out.iter_mut()) {
            *o = Self::dot(w, a);
        }
    }

    fn dot(w: &[u8], a: &[BlockQ8K]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if simd::has_avx2() {
            let mut acc = 0f32;
            for (wb, ab) in w.chunks_exact(210).zip(a) {
                let mut sc = [0i8; 16];
                for (s, &b) in sc.iter_mut().zip(&wb[192..208]) {
                    *s = b as i8;
                }
                // Σ (q − 32)·a = Σ q·a − 32·Σ a, the last sum per group from `bsums`.
                let offset: i32 = sc
                    .iter()
                    .zip(&ab.bsums)
                    .map(|(&s, &b)| i32::from(s) * i32::from(b))
                    .sum();
                // SAFETY: AVX2 is present (checked above), the only requirement of the
                // target-feature function; it checks the slice lengths it reads.
                let unsigned = unsafe { simd::q6_k_sumi(&wb[..128], &wb[128..192], &ab.qs, &sc) };
                let sumi = unsigned - 32 * offset;
                // The same float expression as `dot_scalar`, on the same integer.
                acc += f16_at(wb, 208) * ab.d * sumi as f32;
            }
            return acc;
        }
        Self::dot_scalar(w, a)
    }
}

impl Q6K {
    /// Sixteen groups of 16 with signed 8-bit scales: `d·da·Σ_g sc_g Σ (q − 32)·a`. The
    /// portable definition (the SIMD path is tested against it).
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
        let mut acc = 0f32;
        for (wb, ab) in w.chunks_exact(210).zip(a) {
            let mut groups = [0i32; 16];
            for half in 0..2 {
                let ql = &wb[64 * half..64 * half + 64];
                let qh = &wb[128 + 32 * half..128 + 32 * half + 32];
                for l in 0..32 {
                    for k in 0..4 {
                        let e = 128 * half + l + 32 * k;
                        let q = i32::from(gguf::q6_at(ql, qh, l, k));
                        groups[e / 16] += q * i32::from(ab.qs[e]);
                    }
                }
            }
            let sumi: i32 = groups
                .iter()
                .enumerate()
                .map(|(g, &s)| i32::from(wb[192 + g] as i8) * s)
                .sum();
            acc += f16_at(wb, 208) * ab.d * sumi as f32;
        }
        acc
    }
}

/// AVX2 integer sums of the k-quants. Each returns an exact `i32` (every partial sum is
/// bounded far below overflow), so the result is the portable code's whatever the order.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    pub fn has_avx2() -> bool {
        std::arch::is_x86_feature_detected!("avx2")
    }

    pub fn has_avx2_f16c() -> bool {
        has_avx2() && std::arch::is_x86_feature_detected!("f16c")
    }

    /// One Q5_0 or Q5_1 (`with_min`) weight row against up to [`super::TILE`] activation
    /// rows, `out[t]`: per block the values are unpacked once ([`five_bit_sumi_tile`]),
    /// then each token gets the portable definition's float expression on its exact
    /// integer sum (scales widened from f16 exactly), so its bits.
    #[target_feature(enable = "avx2,f16c")]
    pub fn five_bit_rows(w: &[u8], acts: &[&[super::BlockQ8_1]], with_min: bool, out: &mut [f32]) {
        let k = acts.len().min(super::TILE);
        if k == 0 {
            return;
        }
        let (bytes, qh_at) = if with_min { (24, 4) } else { (22, 2) };
        if k == 1 {
            // A decode step: one token, no lanes to fill.
            let mut acc = 0f32;
            for (wb, ab) in w.chunks_exact(bytes).zip(acts[0]) {
                let [v] = five_bit_madd(
                    &wb[qh_at..qh_at + 4],
                    &wb[qh_at + 4..bytes],
                    !with_min,
                    [&ab.qs],
                );
                let isum = hsum(v);
                let scales = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes([
                    wb[0], wb[1], wb[2], wb[3],
                ])));
                let d = _mm_cvtss_f32(scales);
                acc += if with_min {
                    d * ab.d * isum as f32 + _mm_cvtss_f32(_mm_movehdup_ps(scales)) * ab.s
                } else {
                    d * ab.d * isum as f32
                };
            }
            out[0] = acc;
            return;
        }
        // Lane t is token t: the same multiplies and adds in the same order as the scalar
        // expression `acc += d * d_a * isum (+ m * s_a)`, four tokens side by side.
        let mut acc = _mm_setzero_ps();
        for (i, wb) in w.chunks_exact(bytes).enumerate() {
            let pick = |t: usize| &acts[t.min(k - 1)][i];
            let a: [&[i8; 32]; super::TILE] = std::array::from_fn(|t| &pick(t).qs);
            let sums = _mm_cvtepi32_ps(five_bit_sumi_tile(
                &wb[qh_at..qh_at + 4],
                &wb[qh_at + 4..bytes],
                !with_min,
                a,
            ));
            let scales = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes([
                wb[0], wb[1], wb[2], wb[3],
            ])));
            let d = _mm_shuffle_ps::<0>(scales, scales);
            let da = _mm_setr_ps(pick(0).d, pick(1).d, pick(2).d, pick(3).d);
            let mut term = _mm_mul_ps(_mm_mul_ps(d, da), sums);
            if with_min {
                let m = _mm_shuffle_ps::<0b01_01_01_01>(scales, scales);
                let sa = _mm_setr_ps(pick(0).s, pick(1).s, pick(2).s, pick(3).s);
                term = _mm_add_ps(term, _mm_mul_ps(m, sa));
            }
            acc = _mm_add_ps(acc, term);
        }
        let mut lanes = [0f32; super::TILE];
        // SAFETY: `lanes` is 4 writable f32.
        unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), acc) };
        out[..k].copy_from_slice(&lanes[..k]);
    }

    /// Sum of the eight `i32` lanes.
    #[target_feature(enable = "avx2")]
    fn hsum(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }

    /// 32 bytes from `b[at..at + 32]`.
    #[target_feature(enable = "avx2")]
    fn load<T: Copy>(b: &[T], at: usize) -> __m256i {
        let s = &b[at..at + 32 / std::mem::size_of::<T>()];
        // SAFETY: `s` is exactly 32 bytes of plain integers (the slice index above panics
        // otherwise); the load is unaligned.
        unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
    }

    /// `Σ_j sc[j] · Σ_l q[32j + l] · a[32j + l]` for one Q4_K super-block: `qs` its 128
    /// bytes of nibbles (sub-block 2c in the low nibbles of bytes 32c.., 2c + 1 in the high
    /// ones), `a` the Q8_K quants. Products are at most 15 · 127, so the pairwise i16 sums
    /// of `maddubs` never saturate.
    #[target_feature(enable = "avx2")]
    pub fn q4_k_sumi(qs: &[u8], a: &[i8; 256], sc: &[u8; 8]) -> i32 {
        assert!(qs.len() >= 128);
        let mask = _mm256_set1_epi8(0x0f);
        let mut acc = _mm256_setzero_si256();
        for c in 0..4 {
            let q = load(qs, 32 * c);
            let lo = _mm256_and_si256(q, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask);
            let p_lo = _mm256_maddubs_epi16(lo, load(a, 64 * c));
            let p_hi = _mm256_maddubs_epi16(hi, load(a, 64 * c + 32));
            let s_lo = _mm256_madd_epi16(p_lo, _mm256_set1_epi16(i16::from(sc[2 * c])));
            let s_hi = _mm256_madd_epi16(p_hi, _mm256_set1_epi16(i16::from(sc[2 * c + 1])));
            acc = _mm256_add_epi32(acc, _mm256_add_epi32(s_lo, s_hi));
        }
        hsum(acc)
    }

    /// As [`q4_k_sumi`] for Q5_K: the fifth bit of sub-block `j`'s element `l` is bit `j` of
    /// `qh[l]`. Products are at most 31 · 127, so `maddubs` never saturates.
    #[target_feature(enable = "avx2")]
    pub fn q5_k_sumi(qh: &[u8], qs: &[u8], a: &[i8; 256], sc: &[u8; 8]) -> i32 {
        assert!(qh.len() >= 32 && qs.len() >= 128);
        let mask = _mm256_set1_epi8(0x0f);
        let five = _mm256_set1_epi8(0x10);
        let h = load(qh, 0);
        // 0x10 where bit `j` of `qh[l]` is set.
        let high = |j: usize| {
            let bit = _mm256_set1_epi8((1u8 << j) as i8);
            _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), five)
        };
        let mut acc = _mm256_setzero_si256();
        for c in 0..4 {
            let q = load(qs, 32 * c);
            let lo = _mm256_or_si256(_mm256_and_si256(q, mask), high(2 * c));
            let hi = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask),
                high(2 * c + 1),
            );
            let p_lo = _mm256_maddubs_epi16(lo, load(a, 64 * c));
            let p_hi = _mm256_maddubs_epi16(hi, load(a, 64 * c + 32));
            let s_lo = _mm256_madd_epi16(p_lo, _mm256_set1_epi16(i16::from(sc[2 * c])));
            let s_hi = _mm256_madd_epi16(p_hi, _mm256_set1_epi16(i16::from(sc[2 * c + 1])));
            acc = _mm256_add_epi32(acc, _mm256_add_epi32(s_lo, s_hi));
        }
        hsum(acc)
    }

    /// `Σ_g sc[g] · Σ_{e in g} q[e] · a[e]` for one Q6_K super-block with the 6-bit values
    /// taken unsigned (0..63; the caller subtracts the offset of 32): `ql` 128 bytes of low
    /// nibbles, `qh` 64 bytes of high bit pairs, groups of 16. Products are at most
    /// 63 · 127, so `maddubs` never saturates.
    #[target_feature(enable = "avx2")]
    pub fn q6_k_sumi(ql: &[u8], qh: &[u8], a: &[i8; 256], sc: &[i8; 16]) -> i32 {
        assert!(ql.len() >= 128 && qh.len() >= 64);
        let m4 = _mm256_set1_epi8(0x0f);
        let m2 = _mm256_set1_epi8(0x03);
        let mut acc = _mm256_setzero_si256();
        for half in 0..2 {
            let l0 = load(ql, 64 * half);
            let l1 = load(ql, 64 * half + 32);
            let h = load(qh, 32 * half);
            // Element 128·half + 32·k + l: low nibble of ql[l] (k = 0), ql[l + 32] (1),
            // high nibble of ql[l] (2), ql[l + 32] (3); high bits (qh[l] >> 2k) & 3.
            let lows = [
                _mm256_and_si256(l0, m4),
                _mm256_and_si256(l1, m4),
                _mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4),
                _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4),
            ];
            let highs = [
                _mm256_and_si256(h, m2),
                _mm256_and_si256(_mm256_srli_epi16::<2>(h), m2),
                _mm256_and_si256(_mm256_srli_epi16::<4>(h), m2),
                _mm256_and_si256(_mm256_srli_epi16::<6>(h), m2),
            ];
            for k in 0..4 {
                let q = _mm256_or_si256(lows[k], _mm256_slli_epi16::<4>(highs[k]));
                let e = 128 * half + 32 * k;
                let p = _mm256_maddubs_epi16(q, load(a, e));
                // The low 128 bits hold group e / 16, the high ones the next.
                let g = e / 16;
                let scales = _mm256_set_m128i(
                    _mm_set1_epi16(i16::from(sc[g + 1])),
                    _mm_set1_epi16(i16::from(sc[g])),
                );
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, scales));
            }
        }
        hsum(acc)
    }

    /// [`q4_k_sumi`] for a tile of [`super::TILE`] activation rows: the nibbles unpacked and
    /// the scale vectors built once. Integer sums are exact, so each equals `q4_k_sumi`'s.
    #[target_feature(enable = "avx2")]
    pub fn q4_k_sumi_tile(
        qs: &[u8],
        a: [&[i8; 256]; super::TILE],
        sc: &[u8; 8],
    ) -> [i32; super::TILE] {
        assert!(qs.len() >= 128);
        let mask = _mm256_set1_epi8(0x0f);
        let mut acc = [_mm256_setzero_si256(); super::TILE];
        for c in 0..4 {
            let q = load(qs, 32 * c);
            let lo = _mm256_and_si256(q, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask);
            let sc_lo = _mm256_set1_epi16(i16::from(sc[2 * c]));
            let sc_hi = _mm256_set1_epi16(i16::from(sc[2 * c + 1]));
            for (t, x) in a.iter().enumerate() {
                let s_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load(&x[..], 64 * c)), sc_lo);
                let s_hi =
                    _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load(&x[..], 64 * c + 32)), sc_hi);
                acc[t] = _mm256_add_epi32(acc[t], _mm256_add_epi32(s_lo, s_hi));
            }
        }
        acc.map(|v| hsum(v))
    }

    /// [`q5_k_sumi`] for a tile, as [`q4_k_sumi_tile`].
    #[target_feature(enable = "avx2")]
    pub fn q5_k_sumi_tile(
        qh: &[u8],
        qs: &[u8],
        a: [&[i8; 256]; super::TILE],
        sc: &[u8; 8],
    ) -> [i32; super::TILE] {
        assert!(qh.len() >= 32 && qs.len() >= 128);
        let mask = _mm256_set1_epi8(0x0f);
        let five = _mm256_set1_epi8(0x10);
        let h = load(qh, 0);
        let high = |j: usize| {
            let bit = _mm256_set1_epi8((1u8 << j) as i8);
            _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), five)
        };
        let mut acc = [_mm256_setzero_si256(); super::TILE];
        for c in 0..4 {
            let q = load(qs, 32 * c);
            let lo = _mm256_or_si256(_mm256_and_si256(q, mask), high(2 * c));
            let hi = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask),
                high(2 * c + 1),
            );
            let sc_lo = _mm256_set1_epi16(i16::from(sc[2 * c]));
            let sc_hi = _mm256_set1_epi16(i16::from(sc[2 * c + 1]));
            for (t, x) in a.iter().enumerate() {
                let s_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load(&x[..], 64 * c)), sc_lo);
                let s_hi =
                    _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load(&x[..], 64 * c + 32)), sc_hi);
                acc[t] = _mm256_add_epi32(acc[t], _mm256_add_epi32(s_lo, s_hi));
            }
        }
        acc.map(|v| hsum(v))
    }

    /// [`q6_k_sumi`] for a tile, as [`q4_k_sumi_tile`].
    #[target_feature(enable = "avx2")]
    pub fn q6_k_sumi_tile(
        ql: &[u8],
        qh: &[u8],
        a: [&[i8; 256]; super::TILE],
        sc: &[i8; 16],
    ) -> [i32; super::TILE] {
        assert!(ql.len() >= 128 && qh.len() >= 64);
        let m4 = _mm256_set1_epi8(0x0f);
        let m2 = _mm256_set1_epi8(0x03);
        let mut acc = [_mm256_setzero_si256(); super::TILE];
        for half in 0..2 {
            let l0 = load(ql, 64 * half);
            let l1 = load(ql, 64 * half + 32);
            let h = load(qh, 32 * half);
            let lows = [
                _mm256_and_si256(l0, m4),
                _mm256_and_si256(l1, m4),
                _mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4),
                _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4),
            ];
            let highs = [
                _mm256_and_si256(h, m2),
                _mm256_and_si256(_mm256_srli_epi16::<2>(h), m2),
                _mm256_and_si256(_mm256_srli_epi16::<4>(h), m2),
                _mm256_and_si256(_mm256_srli_epi16::<6>(h), m2),
            ];
            for k in 0..4 {
                let q = _mm256_or_si256(lows[k], _mm256_slli_epi16::<4>(highs[k]));
                let e = 128 * half + 32 * k;
                let g = e / 16;
                let scales = _mm256_set_m128i(
                    _mm_set1_epi16(i16::from(sc[g + 1])),
                    _mm_set1_epi16(i16::from(sc[g])),
                );
                for (t, x) in a.iter().enumerate() {
                    let p = _mm256_maddubs_epi16(q, load(&x[..], e));
                    acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(p, scales));
                }
            }
        }
        acc.map(|v| hsum(v))
    }

    /// The pairwise `Σ q·a` (eight `i32` lanes per token) for one Q5_0 (`centered`: values
    /// `q − 16`) or Q5_1 (values `q`) block against `N` Q8 blocks: `qh` the 32 fifth bits, `qs` 16 bytes of nibbles (elements
    /// 0..16 low, 16..32 high). Exact `i32` sums, lane `t` for token `t`, so equal to the
    /// portable code's. `|q − 16|`
    /// is at most 16 and `q` at most 31, so `maddubs` never saturates.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn five_bit_madd<const N: usize>(
        qh: &[u8],
        qs: &[u8],
        centered: bool,
        a: [&[i8; 32]; N],
    ) -> [__m256i; N] {
        assert!(qh.len() >= 4 && qs.len() >= 16);
        let mask = _mm_set1_epi8(0x0f);
        // SAFETY: `qs` holds at least 16 bytes (asserted); the load is unaligned.
        let q = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
        let nibbles = _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16::<4>(q), mask),
            _mm_and_si128(q, mask),
        );
        // Byte j of the bit mask tests bit j of `qh`: broadcast byte j / 8, mask bit j % 8.
        let bits = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits as i32),
            _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                3, 3, 3, 3,
            ),
        );
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        let values = _mm256_or_si256(nibbles, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
        let ones = _mm256_set1_epi16(1);
        let sum = |x: __m256i| {
            let p = if centered {
                let v = _mm256_sub_epi8(values, _mm256_set1_epi8(16));
                _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(x, v))
            } else {
                _mm256_maddubs_epi16(values, x)
            };
            _mm256_madd_epi16(p, ones)
        };
        a.map(|x| sum(load(&x[..], 0)))
    }

    /// [`five_bit_madd`] for a whole tile, reduced: lane `t` is token `t`'s exact sum.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn five_bit_sumi_tile(
        qh: &[u8],
        qs: &[u8],
        centered: bool,
        a: [&[i8; 32]; super::TILE],
    ) -> __m128i {
        let v = five_bit_madd(qh, qs, centered, a);
        // The four lane sums at once: pairwise horizontal adds, then the two halves.
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h))
    }
}

/// What [`crate::weights::Matrix`] needs of a matrix in any of these formats.
pub trait BlockMatrix: Send + Sync {
    fn ty(&self) -> GgmlType;
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// Whether the product takes Q8_K activations (else Q8_1).
    fn wants_q8_k(&self) -> bool;
    /// `out[r * n + t] = dot(W[r0 + r], x[t])` for `nr` rows and `n` tokens.
    fn rows_kernel(&self, r0: usize, nr: usize, acts: &Acts<'_>, n: usize, out: &mut [f32]);
    /// Row `r` dequantized (embedding lookups).
    fn row_f32(&self, r: usize, out: &mut [f32]);
}

/// A matrix of format `F`, as ggml's bytes, row after row.
pub struct QuantMatrix<F> {
    rows: usize,
    cols: usize,
    data: Vec<u8>,
    format: PhantomData<F>,
}

impl<F: QuantFormat> QuantMatrix<F> {
    /// `data` must hold `rows` rows of `cols` elements (the GGUF reader checked the size;
    /// `cols` is a whole number of blocks).
    pub fn new(rows: usize, cols: usize, data: Vec<u8>) -> Self {
        debug_assert_eq!(cols % F::TYPE.block_elems(), 0);
        debug_assert_eq!(data.len(), rows * Self::row_bytes(cols));
        QuantMatrix {
            rows,
            cols,
            data,
            format: PhantomData,
        }
    }

    fn row_bytes(cols: usize) -> usize {
        cols / F::TYPE.block_elems() * F::TYPE.block_bytes()
    }

    fn row(&self, r: usize) -> &[u8] {
        let rb = Self::row_bytes(self.cols);
        &self.data[r * rb..(r + 1) * rb]
    }
}

impl<F: QuantFormat> BlockMatrix for QuantMatrix<F> {
    fn ty(&self) -> GgmlType {
        F::TYPE
    }

    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn wants_q8_k(&self) -> bool {
        F::Act::ELEMS == QK_K
    }

    fn rows_kernel(&self, r0: usize, nr: usize, acts: &Acts<'_>, n: usize, out: &mut [f32]) {
        let x = F::Act::pick(acts);
        let nb = self.cols / F::Act::ELEMS;
        let mut acts: [&[F::Act]; TILE] = [&[]; TILE];
        for r in 0..nr {
            let w = self.row(r0 + r);
            let mut t = 0;
            while t < n {
                let k = (n - t).min(TILE);
                for (j, a) in acts.iter_mut().enumerate().take(k) {
                    *a = &x[(t + j) * nb..(t + j + 1) * nb];
                }
                F::dot_tile(w, &acts[..k], &mut out[r * n + t..r * n + t + k]);
                t += k;
            }
        }
    }

    fn row_f32(&self, r: usize, out: &mut [f32]) {
        F::TYPE.dequantize(self.row(r), out);
    }
}

/// A boxed matrix for ggml type `ty`, or `None` if no format here implements it.
pub fn block_matrix(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
) -> Option<Box<dyn BlockMatrix>> {
    fn boxed<F: QuantFormat>(rows: usize, cols: usize, data: Vec<u8>) -> Box<dyn BlockMatrix> {
        Box::new(QuantMatrix::<F>::new(rows, cols, data))
    }
    Some(match ty {
        GgmlType::Q5_0 => boxed::<Q5_0>(rows, cols, data),
        GgmlType::Q5_1 => boxed::<Q5_1>(rows, cols, data),
        GgmlType::Q4_K => boxed::<Q4K>(rows, cols, data),
        GgmlType::Q5_K => boxed::<Q5K>(rows, cols, data),
        GgmlType::Q6_K => boxed::<Q6K>(rows, cols, data),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::matmul;
    use crate::weights::{quantize_row_q8_1, Matrix};

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    /// Each format's kernel against the f32 product of the scalar reference dequantization
    /// of the weights (gguf's, written from ggml's definitions) and of the activations the
    /// kernel was given: the integer sums are exact, so only float rounding may differ. Rows
    /// are also identical alone and batched.
    #[test]
    fn kernels_match_the_reference_dequantization() {
        let (rows, cols, n) = (11, 512, 5);
        let mut s = 7u64;
        let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s) * 3.0).collect();
        let mut xq = vec![BlockQ8_1::default(); n * cols / QK];
        for (row, o) in x.chunks_exact(cols).zip(xq.chunks_exact_mut(cols / QK)) {
            quantize_row_q8_1(row, o);
        }
        let mut xk = vec![BlockQ8K::default(); n * cols / QK_K];
        for (row, o) in x.chunks_exact(cols).zip(xk.chunks_exact_mut(cols / QK_K)) {
            quantize_row_q8_k(row, o);
        }
        let deq_q8_1: Vec<f32> = xq
            .iter()
            .flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d))
            .collect();
        let deq_q8_k: Vec<f32> = xk
            .iter()
            .flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d))
            .collect();
        for (i, b) in xk.iter().enumerate() {
            for (g, &sum) in b.bsums.iter().enumerate() {
                let want: i32 = b.qs[16 * g..16 * g + 16]
                    .iter()
                    .map(|&q| i32::from(q))
                    .sum();
                assert_eq!(i32::from(sum), want, "block {i} group {g}");
            }
        }
        // Q8_K is within half a step of its input.
        for (a, b) in x.iter().zip(&deq_q8_k) {
            assert!((a - b).abs() <= 3.0 / 127.0 * 0.5 + 1e-5, "{a} vs {b}");
        }

        for ty in [
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ] {
            let vals: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s)).collect();
            let mut w = gguf::GgufWriter::new();
            w.tensor_f32("w", &[cols as u64, rows as u64], ty, &vals);
            let f = gguf::GgufFile::parse(w.to_bytes()).expect("parses");
            let info = f.tensor("w").expect("tensor");
            let deq = f.tensor_f32(info);
            let m = Matrix::load(&f, info, rows, cols).expect("loads");
            assert!(matches!(&m, Matrix::Blocks(b) if b.ty() == ty));
            let mut out = vec![0f32; n * rows];
            matmul(&m, &x, &xq, n, &mut out);
            let xin = if m.wants_q8_k() { &deq_q8_k } else { &deq_q8_1 };
            for t in 0..n {
                for r in 0..rows {
                    let want: f64 = (0..cols)
                        .map(|c| deq[r * cols + c] as f64 * xin[t * cols + c] as f64)
                        .sum();
                    let got = out[t * rows + r] as f64;
                    // Q5_1's offset term uses the f16-rounded activation sum, as ggml's.
                    let tol = if ty == GgmlType::Q5_1 { 2e-2 } else { 1e-4 };
                    assert!(
                        (want - got).abs() < tol * (1.0 + want.abs()),
                        "{ty:?} t{t} r{r}: {want} vs {got}"
                    );
                }
                let mut one = vec![0f32; rows];
                let nb = cols / QK;
                matmul(
                    &m,
                    &x[t * cols..(t + 1) * cols],
                    &xq[t * nb..(t + 1) * nb],
                    1,
                    &mut one,
                );
                assert_eq!(one, out[t * rows..(t + 1) * rows], "{ty:?} token {t}");
            }
            // Embedding lookups dequantize the row.
            let mut row = vec![0f32; cols];
            m.row_f32(3, &mut row);
            assert_eq!(row, deq[3 * cols..4 * cols]);
        }
    }

    /// The dispatched Q4_K, Q5_K and Q6_K products (AVX2 where the CPU has it) give the portable
    /// definition's bits: the same integers, then the same float expression.
    #[test]
    fn simd_k_quants_equal_the_scalar_definition_bit_for_bit() {
        let mut s = 11u64;
        for (ty, blocks) in [
            (GgmlType::Q4_K, 3),
            (GgmlType::Q5_K, 3),
            (GgmlType::Q6_K, 3),
        ] {
            for trial in 0..20 {
                let cols = blocks * QK_K;
                // Wide value ranges, so quants reach their extremes (0 and 15 or 63).
                let amp = 1.0 + trial as f32;
                let vals: Vec<f32> = (0..cols).map(|_| lcg(&mut s) * amp).collect();
                let w = ty.quantize(&vals);
                let x: Vec<f32> = (0..cols).map(|_| lcg(&mut s) * amp).collect();
                let mut xk = vec![BlockQ8K::default(); blocks];
                quantize_row_q8_k(&x, &mut xk);
                let (fast, slow) = match ty {
                    GgmlType::Q4_K => (Q4K::dot(&w, &xk), Q4K::dot_scalar(&w, &xk)),
                    GgmlType::Q5_K => (Q5K::dot(&w, &xk), Q5K::dot_scalar(&w, &xk)),
                    _ => (Q6K::dot(&w, &xk), Q6K::dot_scalar(&w, &xk)),
                };
                assert_eq!(fast.to_bits(), slow.to_bits(), "{ty:?} trial {trial}");
            }
        }
    }

    /// A tile of 2, 3 or 4 tokens gives each token exactly `dot`'s bits (the tile kernels
    /// share unpacking, never arithmetic).
    #[test]
    fn k_quant_tiles_equal_one_token_at_a_time() {
        let mut s = 13u64;
        for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
            let cols = 2 * QK_K;
            let vals: Vec<f32> = (0..cols).map(|_| lcg(&mut s) * 3.0).collect();
            let w = ty.quantize(&vals);
            let xs: Vec<Vec<BlockQ8K>> = (0..4)
                .map(|_| {
                    let x: Vec<f32> = (0..cols).map(|_| lcg(&mut s) * 5.0).collect();
                    let mut xk = vec![BlockQ8K::default(); 2];
                    quantize_row_q8_k(&x, &mut xk);
                    xk
                })
                .collect();
            for k in 2..=4 {
                let acts: Vec<&[BlockQ8K]> = xs[..k].iter().map(|x| x.as_slice()).collect();
                let mut tile = [0f32; 4];
                let single: Vec<f32> = match ty {
                    GgmlType::Q4_K => {
                        Q4K::dot_tile(&w, &acts, &mut tile);
                        acts.iter().map(|a| Q4K::dot(&w, a)).collect()
                    }
                    GgmlType::Q5_K => {
                        Q5K::dot_tile(&w, &acts, &mut tile);
                        acts.iter().map(|a| Q5K::dot(&w, a)).collect()
                    }
                    _ => {
                        Q6K::dot_tile(&w, &acts, &mut tile);
                        acts.iter().map(|a| Q6K::dot(&w, a)).collect()
                    }
                };
                for (t, v) in single.iter().enumerate() {
                    assert_eq!(
                        tile[t].to_bits(),
                        v.to_bits(),
                        "{ty:?} tile of {k}, token {t}"
                    );
                }
            }
        }
    }

    /// Q5_0 and Q5_1 through the SIMD tile (one token and tiles of 2 to 4) against the
    /// portable definition, bit for bit, with values at both ends of the five-bit range.
    #[test]
    fn five_bit_simd_equals_the_scalar_definition_bit_for_bit() {
        let mut s = 17u64;
        for ty in [GgmlType::Q5_0, GgmlType::Q5_1] {
            for trial in 0..10 {
                let cols = 4 * QK;
                let amp = 1.0 + trial as f32;
                let vals: Vec<f32> = (0..cols).map(|_| lcg(&mut s) * amp).collect();
                let w = ty.quantize(&vals);
                let xs: Vec<Vec<BlockQ8_1>> = (0..4)
                    .map(|_| {
                        let x: Vec<f32> = (0..cols).map(|_| lcg(&mut s) * amp).collect();
                        let mut xq = vec![BlockQ8_1::default(); 4];
                        crate::weights::quantize_row_q8_1(&x, &mut xq);
                        xq
                    })
                    .collect();
                for k in 1..=4 {
                    let acts: Vec<&[BlockQ8_1]> = xs[..k].iter().map(|x| x.as_slice()).collect();
                    let mut tile = [0f32; 4];
                    let slow: Vec<f32> = if ty == GgmlType::Q5_0 {
                        Q5_0::dot_tile(&w, &acts, &mut tile);
                        acts.iter().map(|a| Q5_0::dot_scalar(&w, a)).collect()
                    } else {
                        Q5_1::dot_tile(&w, &acts, &mut tile);
                        acts.iter().map(|a| Q5_1::dot_scalar(&w, a)).collect()
                    };
                    for (t, v) in slow.iter().enumerate() {
                        assert_eq!(
                            tile[t].to_bits(),
                            v.to_bits(),
                            "{ty:?} trial {trial} tile {k} token {t}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn unsupported_types_are_refused_by_name() {
        let e = gguf::GgufError::UnknownTensorType {
            name: "blk.0.ffn_down.weight".into(),
            ty: 16,
        };
        let msg = e.to_string();
        assert!(
            msg.contains("IQ2_XXS") && msg.contains("blk.0.ffn_down.weight"),
            "{msg}"
        );
        let e = gguf::GgufError::UnknownTensorType {
            name: "w".into(),
            ty: 10,
        };
        assert!(e.to_string().contains("Q2_K"), "{e}");
    }
}
