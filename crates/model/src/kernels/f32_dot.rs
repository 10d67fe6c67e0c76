//! The f32 dot product (f32 weights, LoRA pairs), in one fixed order: eight independent
//! accumulators (lane `j` takes elements `8i + j`), reduced as
//! `((a0+a4)+(a2+a6))+((a1+a5)+(a3+a7))`, then the tail by fused multiply-adds. The AVX2
//! body keeps the eight accumulators in one register and reduces them in that order, so
//! both paths give the same bits.

/// f32 dot product of two equal-length slices.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx2() {
        // SAFETY: AVX2 and FMA were detected on this CPU (`has_avx2` checks both).
        return unsafe { x86::dot_f32_avx2(a, b) };
    }
    dot_f32_portable(a, b)
}

/// The definition: what every path computes.
pub fn dot_f32_portable(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [0f32; 8];
    let chunks = n / 8;
    for i in 0..chunks {
        for j in 0..8 {
            acc[j] = a[i * 8 + j].mul_add(b[i * 8 + j], acc[j]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for i in chunks * 8..n {
        s = a[i].mul_add(b[i], s);
    }
    s
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let chunks = n / 8;
        let mut acc = _mm256_setzero_ps();
        for i in 0..chunks {
            // SAFETY: `i * 8 + 8 <= n`, within both slices; `loadu` needs no alignment.
            let (va, vb) = unsafe {
                (
                    _mm256_loadu_ps(a.as_ptr().add(i * 8)),
                    _mm256_loadu_ps(b.as_ptr().add(i * 8)),
                )
            };
            acc = _mm256_fmadd_ps(va, vb, acc);
        }
        // Lanes 0..4 plus lanes 4..8, then (t0 + t2) + (t1 + t3): the portable order.
        let t = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let u = _mm_add_ps(t, _mm_movehl_ps(t, t));
        let mut s = _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
        for i in chunks * 8..n {
            s = a[i].mul_add(b[i], s);
        }
        s
    }
}
