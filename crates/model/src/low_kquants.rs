//! Q2_K and Q3_K against Q8_K activations: one [`QuantFormat`] each, a portable definition
//! and an AVX2 build of its integer part, dispatched at run time as the other k-quants in
//! `quant.rs` are, and for prefill on AVX-512 CPUs the register tiles of
//! `kernels/x86_512_low_kquants.rs`.
//!
//! Both formats have sixteen groups of 16 per super-block. Their dot products are written
//! as exact integer sums per group, scaled by the group's integer scale, then one float
//! expression per super-block; integer sums do not depend on their order, so the SIMD and
//! portable paths give the same bits.

use gguf::{GgmlType, QK_K};

use crate::quant::{f16_at, BlockQ8K, QuantFormat};

/// Bytes of one Q2_K super-block.
const Q2_K_BYTES: usize = 84;
/// Bytes of one Q3_K super-block.
const Q3_K_BYTES: usize = 110;

/// llama.cpp's `hsum_float_8`: the order in which its AVX2 kernels add their eight lanes.
pub(crate) fn hsum8(acc: [f32; 8]) -> f32 {
    let r: [f32; 4] = std::array::from_fn(|j| acc[4 + j] + acc[j]);
    (r[0] + r[2]) + (r[1] + r[3])
}

/// The eight lane sums of a super-block as llama.cpp's AVX2 kernels form them: lane `i` holds
/// elements `4i..4i+4` (mod 32) of every 32-element chunk `c` (element `32c + 4i + ...`),
/// each chunk's share multiplied by the scale of its group (`2c + (i >= 4)`). `value(e)` is
/// element `e`'s quant, `scale(g)` group `g`'s integer scale.
fn lanes(value: impl Fn(usize) -> i32, scale: impl Fn(usize) -> i32, a: &[i8; QK_K]) -> [i32; 8] {
    let mut lanes = [0i32; 8];
    for c in 0..8 {
        for (i, lane) in lanes.iter_mut().enumerate() {
            let s: i32 = (32 * c + 4 * i..32 * c + 4 * i + 4)
                .map(|e| value(e) * i32::from(a[e]))
                .sum();
            *lane += scale(2 * c + usize::from(i >= 4)) * s;
        }
    }
    lanes
}

/// Q2_K: `x = d·(sc_g & 15)·q − dmin·(sc_g >> 4)` with `q` in 0..4, so
/// `Σ x·a = d·da·Σ_g sc_g Σ q·a − dmin·da·Σ_g m_g Σ a`, in llama.cpp's AVX2 float order
/// (`ggml_vec_dot_q2_K_q8_K`): per super-block, eight lanes of the min term (groups `2i`,
/// `2i + 1` from `bsums`) and eight of the scaled sums, each added to its lane accumulator by
/// a fused multiply-add, then [`hsum8`]. So the logits are llama.cpp's bit for bit.
pub struct Q2K;

impl Q2K {
    /// The portable definition (the SIMD path is tested against it).
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
        Self::dot_with(w, a, |wb, ab, sc| {
            let qs = &wb[16..80];
            lanes(
                |e| i32::from(gguf::q2_bits(qs, e)),
                |g| i32::from(sc[g]),
                &ab.qs,
            )
        })
    }

    /// The float part shared by both paths; `lanes` gives a super-block's scaled sums.
    #[inline(always)]
    fn dot_with(
        w: &[u8],
        a: &[BlockQ8K],
        lanes: impl Fn(&[u8], &BlockQ8K, &[u8; 16]) -> [i32; 8],
    ) -> f32 {
        let mut acc = [0f32; 8];
        for (wb, ab) in w.chunks_exact(Q2_K_BYTES).zip(a) {
            let d = ab.d * f16_at(wb, 80);
            let dmin = -ab.d * f16_at(wb, 82);
            let sc: [u8; 16] = std::array::from_fn(|g| wb[g] & 0x0f);
            let m = |g: usize| i32::from(wb[g] >> 4);
            for (i, acc) in acc.iter_mut().enumerate() {
                let mins = m(2 * i) * i32::from(ab.bsums[2 * i])
                    + m(2 * i + 1) * i32::from(ab.bsums[2 * i + 1]);
                *acc = dmin.mul_add(mins as f32, *acc);
            }
            for (acc, lane) in acc.iter_mut().zip(lanes(wb, ab, &sc)) {
                *acc = d.mul_add(lane as f32, *acc);
            }
        }
        hsum8(acc)
    }
}

impl QuantFormat for Q2K {
    const TYPE: GgmlType = GgmlType::Q2_K;
    type Act = BlockQ8K;

    #[inline(always)]
    fn rows(w: &[u8], row_bytes: usize, x: &[BlockQ8K], nb: usize, n: usize, out: &mut [f32]) {
        crate::kquants::k_quant_matrix_rows::<Self>(w, row_bytes, x, nb, n, out);
    }

    #[inline(always)]
    fn dot(w: &[u8], a: &[BlockQ8K]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if simd::has_avx2() {
            // SAFETY: AVX2 is present (checked above), the only requirement of the
            // target-feature function; it checks the slice lengths it reads.
            return Self::dot_with(w, a, |wb, ab, sc| unsafe {
                simd::q2_k_lanes(&wb[16..80], &ab.qs, sc)
            });
        }
        Self::dot_scalar(w, a)
    }
}

/// Q3_K: `x = d·sc_g·(q − 4)` with `q` in 0..8 (two low bits and a high bit) and signed
/// 6-bit `sc_g`, so `Σ x·a = d·da·Σ_g sc_g Σ (q − 4)·a`, in llama.cpp's AVX2 float order
/// (`ggml_vec_dot_q3_K_q8_K`): eight lanes of scaled signed sums per super-block, each
/// added to its lane accumulator by a fused multiply-add, then [`hsum8`].
pub struct Q3K;

impl Q3K {
    /// The portable definition (the SIMD path is tested against it).
    pub fn dot_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
        Self::dot_with(w, a, |wb, ab| {
            let (hmask, qs) = (&wb[..32], &wb[32..96]);
            let sc = gguf::q3_k_scales(&wb[96..108]);
            lanes(
                |e| i32::from(gguf::q2_bits(qs, e) | (gguf::q3_high_bit(hmask, e) << 2)) - 4,
                |g| i32::from(sc[g]),
                &ab.qs,
            )
        })
    }

    /// The float part shared by both paths; `lanes` gives a super-block's scaled sums (each
    /// path decodes the packed group scales its own way: the scalar decode was a sixth of a
    /// Q3_K file's decode step).
    #[inline(always)]
    fn dot_with(w: &[u8], a: &[BlockQ8K], lanes: impl Fn(&[u8], &BlockQ8K) -> [i32; 8]) -> f32 {
        let mut acc = [0f32; 8];
        for (wb, ab) in w.chunks_exact(Q3_K_BYTES).zip(a) {
            let d = ab.d * f16_at(wb, 108);
            for (acc, lane) in acc.iter_mut().zip(lanes(wb, ab)) {
                *acc = d.mul_add(lane as f32, *acc);
            }
        }
        hsum8(acc)
    }
}

impl QuantFormat for Q3K {
    const TYPE: GgmlType = GgmlType::Q3_K;
    type Act = BlockQ8K;

    #[inline(always)]
    fn rows(w: &[u8], row_bytes: usize, x: &[BlockQ8K], nb: usize, n: usize, out: &mut [f32]) {
        crate::kquants::k_quant_matrix_rows::<Self>(w, row_bytes, x, nb, n, out);
    }

    #[inline(always)]
    fn dot(w: &[u8], a: &[BlockQ8K]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if simd::has_avx2() {
            // SAFETY: AVX2 is present (checked above), the only requirement of the
            // target-feature function; it checks the slice lengths it reads.
            return Self::dot_with(w, a, |wb, ab| unsafe { simd::q3_k_lanes(wb, &ab.qs) });
        }
        Self::dot_scalar(w, a)
    }
}

/// AVX2 lane sums of Q2_K and Q3_K, as llama.cpp's kernels form them (see [`lanes`]). Each
/// lane is an exact `i32`: quants are at most 7 in magnitude, activations at most 127,
/// scales at most 32, so no lane comes near overflow.
#[cfg(target_arch = "x86_64")]
pub(crate) mod simd {
    use std::arch::x86_64::*;

    pub fn has_avx2() -> bool {
        std::arch::is_x86_feature_detected!("avx2")
    }

    /// 32 bytes from `b[at..at + 32]`.
    #[target_feature(enable = "avx2")]
    fn load<T: Copy>(b: &[T], at: usize) -> __m256i {
        let s = &b[at..at + 32 / std::mem::size_of::<T>()];
        // SAFETY: `s` is exactly 32 bytes of plain integers (the slice index above panics
        // otherwise); the load is unaligned.
        unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
    }

    #[target_feature(enable = "avx2")]
    fn store(v: __m256i) -> [i32; 8] {
        let mut out = [0i32; 8];
        // SAFETY: `out` is 32 writable bytes; the store is unaligned.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), v) };
        out
    }

    /// Pairwise i16 sums of 32 products (from `maddubs`), each group's 16 multiplied by its
    /// scale: the low 128 bits hold group g, the high ones group g + 1; i32 lane `i` ends up
    /// with elements `4i..4i+4`.
    #[target_feature(enable = "avx2")]
    fn scaled(p: __m256i, lo: i16, hi: i16) -> __m256i {
        let scales = _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo));
        _mm256_madd_epi16(p, scales)
    }

    /// The four 2-bit fields of each byte of `q`, lowest first. A 16-bit shift moves the
    /// upper byte's bits into the lower byte's top, which the mask drops.
    #[target_feature(enable = "avx2")]
    fn two_bit_fields(q: __m256i) -> [__m256i; 4] {
        let m3 = _mm256_set1_epi8(3);
        [
            _mm256_and_si256(q, m3),
            _mm256_and_si256(_mm256_srli_epi16::<2>(q), m3),
            _mm256_and_si256(_mm256_srli_epi16::<4>(q), m3),
            _mm256_and_si256(_mm256_srli_epi16::<6>(q), m3),
        ]
    }

    /// Q2_K's lanes: `qs` its 64 bytes of 2-bit quants (element `128h + 32j + l` at bits
    /// `2j..` of `qs[32h + l]`), `a` the Q8_K quants, `sc` the sixteen 4-bit group scales.
    /// Products of `maddubs` are at most 2 · 3 · 127, so it never saturates.
    #[target_feature(enable = "avx2")]
    pub fn q2_k_lanes(qs: &[u8], a: &[i8; 256], sc: &[u8; 16]) -> [i32; 8] {
        assert!(qs.len() >= 64);
        let mut acc = _mm256_setzero_si256();
        for h in 0..2 {
            for (j, &v) in two_bit_fields(load(qs, 32 * h)).iter().enumerate() {
                let e = 128 * h + 32 * j;
                let p = _mm256_maddubs_epi16(v, load(a, e));
                let g = e / 16;
                let s = scaled(p, i16::from(sc[g]), i16::from(sc[g + 1]));
                acc = _mm256_add_epi32(acc, s);
            }
        }
        store(acc)
    }

    /// `gguf::q3_k_scales` as `i16`s (group `g` in lane `g`).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn q3_k_scales_i16(s: &[u8]) -> __m256i {
        _mm256_cvtepi8_epi16(q3_k_scale_bytes(s))
    }

    /// `gguf::q3_k_scales` (group `g` in byte `g`), in a few vector instructions.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn q3_k_scale_bytes(s: &[u8]) -> __m128i {
        let s = &s[..12];
        let m4 = _mm_set1_epi8(0x0f);
        // SAFETY: `s` is 12 readable bytes (sliced above); the load reads the first 8,
        // unaligned.
        let low8 = unsafe { _mm_loadl_epi64(s.as_ptr().cast()) };
        // Group g < 8: the low nibble of byte g; g >= 8: the high nibble of byte g - 8.
        let low = _mm_unpacklo_epi64(
            _mm_and_si128(low8, m4),
            _mm_and_si128(_mm_srli_epi16::<4>(low8), m4),
        );
        // Group g's top two bits: bits 2 (g / 4).. of byte 8 + g % 4, so the 32-bit lane
        // g / 4 of the broadcast bytes 8..12, shifted by 2 (g / 4).
        let aux = _mm_set1_epi32(i32::from_le_bytes([s[8], s[9], s[10], s[11]]));
        let high = _mm_and_si128(
            _mm_srlv_epi32(aux, _mm_setr_epi32(0, 2, 4, 6)),
            _mm_set1_epi8(3),
        );
        // Each byte is at most 63 before the subtraction: no carry crosses bytes.
        _mm_sub_epi8(
            _mm_or_si128(low, _mm_slli_epi16::<4>(high)),
            _mm_set1_epi8(32),
        )
    }

    /// Q3_K's lanes of signed values (`q − 4`) for the super-block `wb` (ggml's 110 bytes:
    /// 32 bytes of high bits, element `e`'s at bit `e / 32` of `hmask[e % 32]`, then 64
    /// bytes of low bits laid out as Q2_K's, then the packed group scales). As llama.cpp,
    /// the low bits and the 4 a missing high bit subtracts go through `maddubs` separately
    /// (at most 2 · 4 · 127 each, never saturating) and are subtracted in i16.
    #[target_feature(enable = "avx2")]
    pub fn q3_k_lanes(wb: &[u8], a: &[i8; 256]) -> [i32; 8] {
        assert!(wb.len() >= 108);
        let (hmask, qs) = (&wb[..32], &wb[32..96]);
        let scales = q3_k_scales_i16(&wb[96..108]);
        let four = _mm256_set1_epi8(4);
        let hm = load(hmask, 0);
        // 4 where bit `b` of `hmask[l]` is clear.
        let missing = |b: usize| {
            let bit = _mm256_set1_epi8((1u8 << b) as i8);
            _mm256_andnot_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit), four)
        };
        let mut acc = _mm256_setzero_si256();
        for h in 0..2 {
            // Groups 8h.. (this half's eight) in both 128-bit lanes.
            let half_scales = if h == 0 {
                _mm256_permute2x128_si256::<0x00>(scales, scales)
            } else {
                _mm256_permute2x128_si256::<0x11>(scales, scales)
            };
            for (j, &low) in two_bit_fields(load(qs, 32 * h)).iter().enumerate() {
                let e = 128 * h + 32 * j;
                let x = load(a, e);
                let p = _mm256_sub_epi16(
                    _mm256_maddubs_epi16(low, x),
                    _mm256_maddubs_epi16(missing(4 * h + j), x),
                );
                // Group 2j of the half (its i16 at bytes 4j, 4j + 1) in the low lane,
                // 2j + 1 in the high one.
                let (lo, hi) = (4 * j as i8, 4 * j as i8 + 2);
                let pick: [i8; 32] =
                    std::array::from_fn(|b| (if b < 16 { lo } else { hi }) + (b % 2) as i8);
                // SAFETY: `pick` is 32 readable bytes; the load is unaligned.
                let pick = unsafe { _mm256_loadu_si256(pick.as_ptr().cast()) };
                let s = _mm256_madd_epi16(p, _mm256_shuffle_epi8(half_scales, pick));
                acc = _mm256_add_epi32(acc, s);
            }
        }
        store(acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row_q8_k;
    use half::f16;

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

    /// The AVX2 lanes equal the portable ones, and the lanes add up to a plain loop over
    /// gguf's dequantization layout (so a wrong lane, element or scale fails here even if the
    /// scalar code shared it).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_lanes_follow_the_layout() {
        if !simd::has_avx2() {
            eprintln!("avx2_lanes_follow_the_layout: NOT RUN (no AVX2 on this CPU)");
            return;
        }
        let mut s = 17u64;
        for trial in 0..30 {
            let a = acts(QK_K, 3.0, &mut s)[0];
            let w2 = random_bytes(84, &mut s);
            let sc2: [u8; 16] = std::array::from_fn(|g| w2[g] & 0x0f);
            let q2 = |e: usize| i32::from(gguf::q2_bits(&w2[16..80], e));
            let want: i32 = (0..QK_K)
                .map(|e| i32::from(sc2[e / 16]) * q2(e) * i32::from(a.qs[e]))
                .sum();
            let portable = lanes(q2, |g| i32::from(sc2[g]), &a.qs);
            // SAFETY: AVX2 is present (checked above).
            let got = unsafe { simd::q2_k_lanes(&w2[16..80], &a.qs, &sc2) };
            assert_eq!(got, portable, "Q2_K trial {trial}");
            assert_eq!(got.iter().sum::<i32>(), want, "Q2_K trial {trial}");

            let w3 = random_bytes(110, &mut s);
            let sc3 = gguf::q3_k_scales(&w3[96..108]);
            let q3 = |e: usize| {
                i32::from(gguf::q2_bits(&w3[32..96], e) | (gguf::q3_high_bit(&w3, e) << 2)) - 4
            };
            let want: i32 = (0..QK_K)
                .map(|e| i32::from(sc3[e / 16]) * q3(e) * i32::from(a.qs[e]))
                .sum();
            let portable = lanes(q3, |g| i32::from(sc3[g]), &a.qs);
            // SAFETY: AVX2 is present (checked above).
            let got = unsafe { simd::q3_k_lanes(&w3, &a.qs) };
            assert_eq!(got, portable, "Q3_K trial {trial}");
            assert_eq!(got.iter().sum::<i32>(), want, "Q3_K trial {trial}");
        }
    }

    /// The vector decode of Q3_K's group scales equals gguf's scalar one on every packed
    /// pattern reached by random bytes (and on the all-zero and all-one bytes).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn q3_k_scales_match_gguf() {
        if !simd::has_avx2() {
            eprintln!("q3_k_scales_match_gguf: NOT RUN (no AVX2 on this CPU)");
            return;
        }
        let mut s = 3u64;
        let mut cases = vec![vec![0u8; 12], vec![0xff; 12]];
        cases.extend((0..10_000).map(|_| random_bytes(12, &mut s)));
        for bytes in cases {
            let mut got = [0i16; 16];
            // SAFETY: AVX2 is present (checked above); `got` is 32 writable bytes and the
            // store is unaligned.
            unsafe {
                let v = simd::q3_k_scales_i16(&bytes);
                std::arch::x86_64::_mm256_storeu_si256(got.as_mut_ptr().cast(), v);
            }
            let want = gguf::q3_k_scales(&bytes).map(i16::from);
            assert_eq!(got, want, "{bytes:?}");
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
