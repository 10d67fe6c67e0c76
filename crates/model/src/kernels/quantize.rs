//! Activation quantization to Q8_1 (ggml's `quantize_row_q8_1`) and Q8_K (its
//! `quantize_row_q8_K_ref`): the definitions, and their vector builds, lane for lane: the
//! absolute maximum is exact in any order, and each element's scaling, round-half-even and
//! sum are the scalar path's operations, so the blocks are identical.

use gguf::QK_K;
use half::f16;

use crate::blocks::{BlockQ8K, BlockQ8_1, QK};

/// Quantizes one activation row (length a multiple of 32) the way ggml does for Q8_1:
/// scale `amax / 127` stored as f16, values rounded to nearest, sum scaled and stored as f16.
pub fn quantize_row_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    let done = quantize_blocks_q8_1(x, out);
    quantize_row_q8_1_scalar(&x[done * QK..], &mut out[done..]);
}

/// The definition [`quantize_row_q8_1`]'s SIMD path is tested against.
pub fn quantize_row_q8_1_scalar(x: &[f32], out: &mut [BlockQ8_1]) {
    for (blk, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        // ggml multiplies by 127 / amax, not 1 / d: the two differ in the last bit.
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in o.qs.iter_mut().zip(blk) {
            let r = round_ties_even_small(v * id) as i32;
            *q = r as i8;
            sum += r;
        }
        o.d = f16::from_f32(d).to_f32();
        o.s = f16::from_f32(d * sum as f32).to_f32();
    }
}

/// Round half to even for |y| < 2^22, as `_mm256_round_ps(_MM_ROUND_NEAREST)` does: adding
/// and subtracting 1.5 * 2^23 leaves the integer the FPU rounded to. (`round_ties_even`
/// compiles to a libm call on baseline x86-64, the hottest line of quantization.)
#[inline]
fn round_ties_even_small(y: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    (y + MAGIC) - MAGIC
}

/// Quantizes one activation row (length a multiple of 256) as ggml's reference Q8_K does:
/// the scale comes from the signed value of largest magnitude (`-127 / max`), values round
/// to nearest even and are capped at 127.
pub fn quantize_row_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    let done = quantize_blocks_q8_k(x, out);
    let (x, out) = (&x[done * QK_K..], &mut out[done..]);
    #[cfg(target_arch = "x86_64")]
    if super::cpu::avx2_fma_f16c_detected() {
        // SAFETY: AVX2, FMA and F16C are present (checked), the function's requirement.
        // (Compiled there, the rounding is one instruction instead of a `rintf` call.)
        unsafe { quantize_row_q8_k_for_avx2(x, out) };
        return;
    }
    quantize_row_q8_k_portable(x, out);
}

/// [`quantize_row_q8_k_portable`] compiled for AVX2, FMA and F16C: the rounding becomes one
/// instruction (exactly specified, so the same result) instead of a `rintf` call.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_row_q8_k_for_avx2(x: &[f32], out: &mut [BlockQ8K]) {
    quantize_row_q8_k_portable(x, out);
}

/// The definition of [`quantize_row_q8_k`] (its vector path is tested against it).
#[inline(always)]
pub fn quantize_row_q8_k_portable(x: &[f32], out: &mut [BlockQ8K]) {
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

/// Quantizes whole 32-element blocks of `x` into `out` where the CPU allows; returns how
/// many blocks it did (the caller does the rest, e.g. a block holding a NaN, with the
/// scalar definition).
pub fn quantize_blocks_q8_1(x: &[f32], out: &mut [BlockQ8_1]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx2() {
        // SAFETY: AVX2 and FMA are present (checked); the function stays within both slices.
        return unsafe { x86::quantize(x, out) };
    }
    let _ = (x, out);
    0
}

/// Quantizes whole 256-element blocks of `x` into `out` as [`quantize_row_q8_k`]'s
/// definition does, where the CPU allows; returns how many blocks it did, from the first
/// (the caller does the rest, e.g. a block whose largest magnitude is not a normal float,
/// with the definition itself).
pub fn quantize_blocks_q8_k(x: &[f32], out: &mut [BlockQ8K]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx2() {
        // SAFETY: AVX2 and FMA are present (checked); the function stays within both slices.
        return unsafe { x86::quantize_q8_k(x, out) };
    }
    let _ = (x, out);
    0
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::f16;

    use crate::blocks::{BlockQ8K, BlockQ8_1, QK};
    use gguf::QK_K;

    /// The definition keeps the first element of the largest magnitude as `max` (its sign
    /// sets the scale's); NaNs never compare greater, and `max_ps` with the NaN first keeps
    /// the running maximum, so both skip them as the scalar loop does.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn quantize_q8_k(x: &[f32], out: &mut [BlockQ8K]) -> usize {
        let mut done = 0;
        let sign = _mm256_set1_ps(-0.0);
        // Plain loops, no closures: closures do not inherit the target features, and these
        // stayed calls per block (5% of a Q2_K prefill).
        for (blk, o) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
            let blk: &[f32; QK_K] = blk.try_into().expect("chunks_exact gives whole blocks");
            let mut v = [_mm256_setzero_ps(); 32];
            let mut a = [_mm256_setzero_ps(); 32];
            let mut m = _mm256_setzero_ps();
            for i in 0..32 {
                // SAFETY: `blk` holds 256 f32, so 8 from `8 * i`; unaligned loads are allowed.
                v[i] = unsafe { _mm256_loadu_ps(blk.as_ptr().add(8 * i)) };
                a[i] = _mm256_andnot_ps(sign, v[i]);
                m = _mm256_max_ps(a[i], m);
            }
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            if amax == 0.0 {
                *o = BlockQ8K::default();
                done += 1;
                continue;
            }
            // Below the normal range the scale can overflow, and at infinity every product
            // is NaN or infinite: the definition's `as i32` saturation is left to it.
            if !(amax >= f32::MIN_POSITIVE && amax.is_finite()) {
                break;
            }
            let amax_v = _mm256_set1_ps(amax);
            let mut max = amax;
            for i in 0..32 {
                let hits = _mm256_movemask_ps(_mm256_cmp_ps(a[i], amax_v, _CMP_EQ_OQ));
                if hits != 0 {
                    max = blk[8 * i + hits.trailing_zeros() as usize];
                    break;
                }
            }
            let iscale = -127.0 / max;
            let is = _mm256_set1_ps(iscale);
            // Every product of a finite element is within ±127.5 (|x| <= |max|), so it
            // rounds into i8 range; a NaN element's product is masked to 0, as `as i32`
            // makes it.
            let mut q = [_mm256_setzero_si256(); 32];
            for i in 0..32 {
                let y = _mm256_mul_ps(v[i], is);
                let y = _mm256_and_ps(y, _mm256_cmp_ps(y, y, _CMP_ORD_Q));
                let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(y);
                q[i] = _mm256_min_epi32(_mm256_cvttps_epi32(r), _mm256_set1_epi32(127));
            }
            for (c, q) in q.chunks_exact(4).enumerate() {
                // Values are within ±127, so the saturating packs are exact; they interleave
                // 128-bit lanes, which the final permutation undoes.
                let p16a = _mm256_packs_epi32(q[0], q[1]);
                let p16b = _mm256_packs_epi32(q[2], q[3]);
                let p8 = _mm256_packs_epi16(p16a, p16b);
                let ordered =
                    _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                let dst = &mut o.qs[32 * c..32 * c + 32];
                // SAFETY: `dst` is 32 writable bytes (sliced above); the store is unaligned.
                unsafe { _mm256_storeu_si256(dst.as_mut_ptr().cast(), ordered) };
            }
            for (s, group) in o.bsums.iter_mut().zip(o.qs.chunks_exact(16)) {
                *s = group.iter().map(|&q| i16::from(q)).sum();
            }
            o.d = 1.0 / iscale;
            done += 1;
        }
        done
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn quantize(x: &[f32], out: &mut [BlockQ8_1]) -> usize {
        let mut done = 0;
        let sign = _mm256_set1_ps(-0.0);
        let magic = _mm256_set1_ps(12_582_912.0); // 1.5 * 2^23, as round_ties_even_small
        for (blk, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
            // SAFETY: `blk` holds 32 f32; unaligned loads are allowed.
            let v: [__m256; 4] =
                std::array::from_fn(|i| unsafe { _mm256_loadu_ps(blk.as_ptr().add(i * 8)) });
            let nan = v.iter().fold(0, |m, &x| {
                m | _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))
            });
            if nan != 0 {
                break;
            }
            let a = v.map(|x| _mm256_andnot_ps(sign, x));
            let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let d = amax / 127.0;
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let idv = _mm256_set1_ps(id);
            let q = v.map(|x| {
                let y = _mm256_mul_ps(x, idv);
                _mm256_cvtps_epi32(_mm256_sub_ps(_mm256_add_ps(y, magic), magic))
            });
            let total =
                _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let mut lanes = [0i32; 8];
            // SAFETY: `lanes` is 8 writable i32.
            unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, total) };
            let sum: i32 = lanes.iter().sum();
            // Values are within ±127, so the saturating packs are exact; they interleave
            // 128-bit lanes, which the final permutation undoes.
            let p16a = _mm256_packs_epi32(q[0], q[1]);
            let p16b = _mm256_packs_epi32(q[2], q[3]);
            let p8 = _mm256_packs_epi16(p16a, p16b);
            let ordered =
                _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            // SAFETY: `qs` is 32 writable bytes.
            unsafe { _mm256_storeu_si256(o.qs.as_mut_ptr() as *mut __m256i, ordered) };
            o.d = f16::from_f32(d).to_f32();
            o.s = f16::from_f32(d * sum as f32).to_f32();
            done += 1;
        }
        done
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn magic_rounding_is_round_half_even() {
        let mut y = -130.0f32;
        while y < 130.0 {
            assert_eq!(super::round_ties_even_small(y), y.round_ties_even(), "{y}");
            y += 0.125;
        }
        for y in [
            0.5f32, 1.5, 2.5, -0.5, -1.5, 126.49999, 126.5, 127.5, -127.5,
        ] {
            assert_eq!(super::round_ties_even_small(y), y.round_ties_even(), "{y}");
        }
    }
}
