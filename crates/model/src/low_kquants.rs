//! Q2_K and Q3_K against Q8_K activations: one [`QuantFormat`] each, a portable definition
//! and an AVX2 build of its integer part, dispatched at run time as the other k-quants in
//! `quant.rs` are.
//!
//! Both formats have sixteen groups of 16 per super-block. Their dot products are written
//! as exact integer sums per group, scaled by the group's integer scale, then one float
//! expression per super-block; integer sums do not depend on their order, so the SIMD and
//! portable paths give the same bits.

use gguf::GgmlType;
use half::f16;

use crate::quant::{BlockQ8K, QuantFormat};

/// Bytes of one Q2_K super-block.
const Q2_K_BYTES: usize = 84;
/// Bytes of one Q3_K super-block.
const Q3_K_BYTES: usize = 110;

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// `Σ_g m_g · Σ_{e in g} a_e` over a super-block's sixteen groups, from the activations'
/// `bsums`: the offset term of both formats.
fn group_offsets(m: impl Iterator<Item = i32>, ab: &BlockQ8K) -> i32 {
    m.zip(&ab.bsums).map(|(m, &s)| m * i32::from(s)).sum()
}

/// Q2_K: `x = d·(sc_g & 15)·q − dmin·(sc_g >> 4)` with `q` in 0..4, so
/// `Σ x·a = d·da·Σ_g sc_g Σ q·a − dmin·da·Σ_g m_g Σ a`.
pub struct Q2K;

impl Q2K {
    /// The portable definition (the SIMD path is tested against it).
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
        let mut acc = 0f32;
        for (wb, ab) in w.chunks_exact(Q2_K_BYTES).zip(a) {
            let qs = &wb[16..80];
            let mut sumi = 0i32;
            for (g, &sc) in wb[..16].iter().enumerate() {
                let s: i32 = (16 * g..16 * g + 16)
                    .map(|e| i32::from(gguf::q2_bits(qs, e)) * i32::from(ab.qs[e]))
                    .sum();
                sumi += i32::from(sc & 0x0f) * s;
            }
            let summ = group_offsets(wb[..16].iter().map(|&s| i32::from(s >> 4)), ab);
            acc += f16_at(wb, 80) * ab.d * sumi as f32 - f16_at(wb, 82) * ab.d * summ as f32;
        }
        acc
    }
}

impl QuantFormat for Q2K {
    const TYPE: GgmlType = GgmlType::Q2_K;
    type Act = BlockQ8K;

    fn dot(w: &[u8], a: &[BlockQ8K]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if simd::has_avx2() {
            let mut acc = 0f32;
            for (wb, ab) in w.chunks_exact(Q2_K_BYTES).zip(a) {
                let mut sc = [0u8; 16];
                for (s, &b) in sc.iter_mut().zip(&wb[..16]) {
                    *s = b & 0x0f;
                }
                let summ = group_offsets(wb[..16].iter().map(|&s| i32::from(s >> 4)), ab);
                // SAFETY: AVX2 is present (checked above), the only requirement of the
                // target-feature function; it checks the slice lengths it reads.
                let sumi = unsafe { simd::q2_k_sumi(&wb[16..80], &ab.qs, &sc) };
                // The same float expression as `dot_scalar`, on the same integers.
                acc += f16_at(wb, 80) * ab.d * sumi as f32 - f16_at(wb, 82) * ab.d * summ as f32;
            }
            return acc;
        }
        Self::dot_scalar(w, a)
    }
}

/// Q3_K: `x = d·sc_g·(q − 4)` with `q` in 0..8 (two low bits and a high bit) and signed
/// 6-bit `sc_g`, so `Σ x·a = d·da·(Σ_g sc_g Σ q·a − 4·Σ_g sc_g Σ a)`.
pub struct Q3K;

impl Q3K {
    /// The portable definition (the SIMD path is tested against it).
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
        let mut acc = 0f32;
        for (wb, ab) in w.chunks_exact(Q3_K_BYTES).zip(a) {
            let (hmask, qs) = (&wb[..32], &wb[32..96]);
            let sc = gguf::q3_k_scales(&wb[96..108]);
            let mut sumi = 0i32;
            for (g, &s) in sc.iter().enumerate() {
                let dot: i32 = (16 * g..16 * g + 16)
                    .map(|e| {
                        let q = gguf::q2_bits(qs, e) | (gguf::q3_high_bit(hmask, e) << 2);
                        (i32::from(q) - 4) * i32::from(ab.qs[e])
                    })
                    .sum();
                sumi += i32::from(s) * dot;
            }
            acc += f16_at(wb, 108) * ab.d * sumi as f32;
        }
        acc
    }
}

impl QuantFormat for Q3K {
    const TYPE: GgmlType = GgmlType::Q3_K;
    type Act = BlockQ8K;

    fn dot(w: &[u8], a: &[BlockQ8K]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if simd::has_avx2() {
            let mut acc = 0f32;
            for (wb, ab) in w.chunks_exact(Q3_K_BYTES).zip(a) {
                let sc = gguf::q3_k_scales(&wb[96..108]);
                let offset = group_offsets(sc.iter().map(|&s| i32::from(s)), ab);
                // SAFETY: AVX2 is present (checked above), the only requirement of the
                // target-feature function; it checks the slice lengths it reads.
                let unsigned = unsafe { simd::q3_k_sumi(&wb[..32], &wb[32..96], &ab.qs, &sc) };
                let sumi = unsigned - 4 * offset;
                // The same float expression as `dot_scalar`, on the same integer.
                acc += f16_at(wb, 108) * ab.d * sumi as f32;
            }
            return acc;
        }
        Self::dot_scalar(w, a)
    }
}

/// AVX2 integer sums of Q2_K and Q3_K. Each returns an exact `i32`: quants are at most 7,
/// activations at most 127 in magnitude, scales at most 32, so no lane comes near overflow.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    pub fn has_avx2() -> bool {
        std::arch::is_x86_feature_detected!("avx2")
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

    /// `Σ_e q[e] · a[e]` for 32 consecutive elements (groups `g` and `g + 1`), each group's
    /// sum multiplied by its scale: `q` holds unsigned values below 8, so the pairwise i16
    /// sums of `maddubs` (at most 2 · 7 · 127) never saturate.
    #[target_feature(enable = "avx2")]
    fn scaled_pair(q: __m256i, a: __m256i, lo: i16, hi: i16) -> __m256i {
        let p = _mm256_maddubs_epi16(q, a);
        // The low 128 bits hold group g's 16 products, the high ones group g + 1's.
        let scales = _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo));
        _mm256_madd_epi16(p, scales)
    }

    /// `Σ_g sc[g] · Σ_{e in g} q[e] · a[e]` for one Q2_K super-block: `qs` its 64 bytes of
    /// 2-bit quants (element `128h + 32j + l` at bits `2j..` of `qs[32h + l]`), `a` the Q8_K
    /// quants, `sc` the sixteen 4-bit group scales.
    #[target_feature(enable = "avx2")]
    pub fn q2_k_sumi(qs: &[u8], a: &[i8; 256], sc: &[u8; 16]) -> i32 {
        assert!(qs.len() >= 64);
        let m3 = _mm256_set1_epi8(3);
        let mut acc = _mm256_setzero_si256();
        for h in 0..2 {
            let q = load(qs, 32 * h);
            // A 16-bit shift moves the upper byte's bits into the lower byte's top, which
            // the mask drops: each byte keeps its own bits 2j and 2j + 1.
            let parts = [
                _mm256_and_si256(q, m3),
                _mm256_and_si256(_mm256_srli_epi16::<2>(q), m3),
                _mm256_and_si256(_mm256_srli_epi16::<4>(q), m3),
                _mm256_and_si256(_mm256_srli_epi16::<6>(q), m3),
            ];
            for (j, &v) in parts.iter().enumerate() {
                let e = 128 * h + 32 * j;
                let g = e / 16;
                let s = scaled_pair(v, load(a, e), i16::from(sc[g]), i16::from(sc[g + 1]));
                acc = _mm256_add_epi32(acc, s);
            }
        }
        hsum(acc)
    }

    /// `Σ_g sc[g] · Σ_{e in g} q[e] · a[e]` for one Q3_K super-block with the 3-bit values
    /// taken unsigned (0..8; the caller subtracts the offset of 4): `hmask` 32 bytes of high
    /// bits (element `e`'s at bit `e / 32` of `hmask[e % 32]`), `qs` 64 bytes of low bits
    /// laid out as Q2_K's, `sc` the sixteen signed group scales.
    #[target_feature(enable = "avx2")]
    pub fn q3_k_sumi(hmask: &[u8], qs: &[u8], a: &[i8; 256], sc: &[i8; 16]) -> i32 {
        assert!(hmask.len() >= 32 && qs.len() >= 64);
        let m3 = _mm256_set1_epi8(3);
        let four = _mm256_set1_epi8(4);
        let hm = load(hmask, 0);
        // 4 where bit `b` of `hmask[l]` is set.
        let high = |b: usize| {
            let bit = _mm256_set1_epi8((1u8 << b) as i8);
            _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit), four)
        };
        let mut acc = _mm256_setzero_si256();
        for h in 0..2 {
            let q = load(qs, 32 * h);
            let parts = [
                _mm256_and_si256(q, m3),
                _mm256_and_si256(_mm256_srli_epi16::<2>(q), m3),
                _mm256_and_si256(_mm256_srli_epi16::<4>(q), m3),
                _mm256_and_si256(_mm256_srli_epi16::<6>(q), m3),
            ];
            for (j, &low) in parts.iter().enumerate() {
                let v = _mm256_or_si256(low, high(4 * h + j));
                let e = 128 * h + 32 * j;
                let g = e / 16;
                let s = scaled_pair(v, load(a, e), i16::from(sc[g]), i16::from(sc[g + 1]));
                acc = _mm256_add_epi32(acc, s);
            }
        }
        hsum(acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row_q8_k;
    use gguf::QK_K;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    fn random_bytes(n: usize, seed: &mut u64) -> Vec<u8> {
        (0..n)
            .map(|_| {
                lcg(seed);
                (*seed >> 56) as u8
            })
            .collect()
    }

    fn acts(cols: usize, amp: f32, seed: &mut u64) -> Vec<BlockQ8K> {
        let x: Vec<f32> = (0..cols).map(|_| lcg(seed) * amp).collect();
        let mut xk = vec![BlockQ8K::default(); cols / QK_K];
        quantize_row_q8_k(&x, &mut xk);
        xk
    }

    /// Weight rows of quantized values and of raw random bytes (every bit pattern of the
    /// quants, scales and masks reached), each scale field set to a finite f16.
    fn weights(ty: GgmlType, blocks: usize, trial: usize, seed: &mut u64) -> Vec<u8> {
        let cols = blocks * QK_K;
        if trial.is_multiple_of(2) {
            let amp = 1.0 + trial as f32;
            let vals: Vec<f32> = (0..cols).map(|_| lcg(seed) * amp).collect();
            return ty.quantize(&vals);
        }
        let mut w = random_bytes(blocks * ty.block_bytes(), seed);
        for b in w.chunks_exact_mut(ty.block_bytes()) {
            let d = f16::from_f32(0.01 * (1.0 + lcg(seed).abs())).to_le_bytes();
            match ty {
                GgmlType::Q2_K => {
                    b[80..82].copy_from_slice(&d);
                    b[82..84].copy_from_slice(&f16::from_f32(0.02).to_le_bytes());
                }
                _ => b[108..110].copy_from_slice(&d),
            }
        }
        w
    }

    fn dots(ty: GgmlType, w: &[u8], a: &[BlockQ8K]) -> (f32, f32) {
        match ty {
            GgmlType::Q2_K => (Q2K::dot(w, a), Q2K::dot_scalar(w, a)),
            _ => (Q3K::dot(w, a), Q3K::dot_scalar(w, a)),
        }
    }

    /// The dispatched product (AVX2 where the CPU has it) gives the portable definition's
    /// bits: the same integers, then the same float expression.
    #[test]
    fn simd_equals_the_scalar_definition_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        eprintln!("AVX2 present: {}", simd::has_avx2());
        let mut s = 5u64;
        for ty in [GgmlType::Q2_K, GgmlType::Q3_K] {
            for trial in 0..40 {
                let blocks = 1 + trial % 4;
                let w = weights(ty, blocks, trial, &mut s);
                let a = acts(blocks * QK_K, 1.0 + trial as f32, &mut s);
                let (fast, slow) = dots(ty, &w, &a);
                assert_eq!(fast.to_bits(), slow.to_bits(), "{ty:?} trial {trial}");
            }
        }
    }

    /// The AVX2 integer sums equal a plain loop over gguf's dequantization layout (so a
    /// wrong lane or scale in the SIMD code fails here even if the scalar code shared it).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_integer_sums_follow_the_layout() {
        if !simd::has_avx2() {
            eprintln!("avx2_integer_sums_follow_the_layout: NOT RUN (no AVX2 on this CPU)");
            return;
        }
        let mut s = 17u64;
        for trial in 0..30 {
            let a = acts(QK_K, 3.0, &mut s)[0];
            let w2 = random_bytes(84, &mut s);
            let sc2: [u8; 16] = std::array::from_fn(|g| w2[g] & 0x0f);
            let want: i32 = (0..QK_K)
                .map(|e| {
                    let q = i32::from(gguf::q2_bits(&w2[16..80], e));
                    i32::from(sc2[e / 16]) * q * i32::from(a.qs[e])
                })
                .sum();
            // SAFETY: AVX2 is present (checked above).
            let got = unsafe { simd::q2_k_sumi(&w2[16..80], &a.qs, &sc2) };
            assert_eq!(got, want, "Q2_K trial {trial}");

            let w3 = random_bytes(110, &mut s);
            let sc3 = gguf::q3_k_scales(&w3[96..108]);
            let want: i32 = (0..QK_K)
                .map(|e| {
                    let q = gguf::q2_bits(&w3[32..96], e) | (gguf::q3_high_bit(&w3, e) << 2);
                    i32::from(sc3[e / 16]) * i32::from(q) * i32::from(a.qs[e])
                })
                .sum();
            // SAFETY: AVX2 is present (checked above).
            let got = unsafe { simd::q3_k_sumi(&w3[..32], &w3[32..96], &a.qs, &sc3) };
            assert_eq!(got, want, "Q3_K trial {trial}");
        }
    }

    /// Each product equals the f64 product of gguf's dequantized weights with the
    /// dequantized activations, up to float rounding: the kernels read the layout as the
    /// reference dequantization does.
    #[test]
    fn products_match_the_reference_dequantization() {
        let mut s = 23u64;
        for ty in [GgmlType::Q2_K, GgmlType::Q3_K] {
            for trial in 0..20 {
                let blocks = 2;
                let w = weights(ty, blocks, trial, &mut s);
                let a = acts(blocks * QK_K, 2.0, &mut s);
                let mut deq = vec![0f32; blocks * QK_K];
                ty.dequantize(&w, &mut deq);
                let xa: Vec<f32> = a
                    .iter()
                    .flat_map(|b| b.qs.iter().map(move |&q| f32::from(q) * b.d))
                    .collect();
                let want: f64 = deq
                    .iter()
                    .zip(&xa)
                    .map(|(&x, &y)| f64::from(x) * f64::from(y))
                    .sum();
                let scale: f64 = deq
                    .iter()
                    .zip(&xa)
                    .map(|(&x, &y)| (f64::from(x) * f64::from(y)).abs())
                    .sum();
                let (fast, slow) = dots(ty, &w, &a);
                for got in [fast, slow] {
                    assert!(
                        (f64::from(got) - want).abs() <= 1e-5 * (1.0 + scale),
                        "{ty:?} trial {trial}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
