//! Activation quantization to Q8_1 (ggml's `quantize_row_q8_1`), vectorized lane for lane:
//! the absolute maximum is exact in any order, and each element's `v * (127 / amax)`,
//! round-half-even and sum are the scalar path's operations, so the blocks are identical.

/// Quantizes whole 32-element blocks of `x` into `out` where the CPU allows; returns how
/// many blocks it did (the caller does the rest, e.g. a block holding a NaN, with the
/// scalar definition).
pub fn quantize_blocks_q8_1(x: &[f32], out: &mut [crate::weights::BlockQ8_1]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2() {
        // SAFETY: AVX2 and FMA are present (checked); the function stays within both slices.
        return unsafe { x86::quantize(x, out) };
    }
    let _ = (x, out);
    0
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::f16;

    use crate::weights::{BlockQ8_1, QK};

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
