//! Elementwise activations, lane for lane as ggml computes them.

#[cfg(target_arch = "x86_64")]
use super::cpu::has_avx2;

/// `exp(x)` as ggml's vectorized SwiGLU computes it (its AVX-512 polynomial, which is what
/// llama.cpp runs on the reference machines), evaluated lane by lane. Within 1.5 ulp of the
/// true value; matching it exactly keeps our activations on llama.cpp's side of every
/// quantization boundary.
pub fn ggml_expf(x: f32) -> f32 {
    let r = f32::from_bits(0x4B40_0000); // 0x1.8p23
    let z = x.mul_add(f32::from_bits(0x3FB8_AA3B), r); // log2(e)
    let n = z - r;
    let b = (-n).mul_add(
        f32::from_bits(0x35BF_BE8E),
        (-n).mul_add(f32::from_bits(0x3F31_7200), x),
    );
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let u = b * b;
    let j = f32::from_bits(0x3C07_2010)
        .mul_add(b, f32::from_bits(0x3D2B_9F17))
        .mul_add(
            u,
            f32::from_bits(0x3E2A_AF33).mul_add(b, f32::from_bits(0x3EFF_FEDB)),
        )
        .mul_add(u, f32::from_bits(0x3F7F_FFF6).mul_add(b, 1.0));
    // scalef(j, n): one rounding of j * 2^n, exact in f64 before it (|n| <= 192 here).
    (j as f64 * f64::from_bits(((n as i64 + 1023) as u64) << 52)) as f32
}

/// `gate[i] = silu(gate[i]) * up[i]`, ggml's SwiGLU, vectorized where the CPU allows with
/// the same operations lane by lane as [`silu`] (so the same bits).
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA are present (checked); the function reads and writes only
        // within the first `n` elements of both slices.
        done = unsafe { x86::swiglu(&mut gate[..n], &up[..n]) };
    }
    for (g, u) in gate[done..n].iter_mut().zip(&up[done..n]) {
        *g = silu(*g) * u;
    }
}

/// SiLU as ggml's SwiGLU computes it: `x / (1 + exp(-x))` with [`ggml_expf`].
pub fn silu(x: f32) -> f32 {
    x / (1.0 + ggml_expf(-x))
}

/// `gate[i] = f(gate[i]) * up[i]` for an activation `f` given as `table`, its value at
/// every f16 (indexed by the f16's bits; 65,536 entries), with `f(x) = 0` for `x <= -10` and
/// `f(x) = x` for `x >= 10`: ggml's table-driven GELU. Eight lanes at a time (one f16
/// conversion and one gather) where the CPU has F16C; the rest through `scalar`, which must
/// compute the same (it is the definition).
pub fn table_glu(gate: &mut [f32], up: &[f32], table: &[f32], scalar: impl Fn(f32) -> f32) {
    let n = gate.len().min(up.len());
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_f16c() && table.len() == 1 << 16 {
        // SAFETY: AVX2, FMA and F16C are present (checked); the table has an entry for
        // every 16-bit index (checked); the function stays within the first `n` elements.
        done = unsafe { x86::table_glu(&mut gate[..n], &up[..n], table) };
    }
    for (g, u) in gate[done..n].iter_mut().zip(&up[done..n]) {
        *g = scalar(*g) * u;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// [`super::table_glu`] over whole 8-lane groups; returns how many elements it did.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `table.len() == 65536`;
    /// `gate.len() == up.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn table_glu(gate: &mut [f32], up: &[f32], table: &[f32]) -> usize {
        assert_eq!(table.len(), 1 << 16);
        let mut done = 0;
        for (gc, uc) in gate.chunks_exact_mut(8).zip(up.chunks_exact(8)) {
            // SAFETY: each chunk has 8 elements; unaligned loads are allowed.
            let (x, u) = unsafe { (_mm256_loadu_ps(gc.as_ptr()), _mm256_loadu_ps(uc.as_ptr())) };
            // Round to nearest even, as the scalar conversion does; the bits index the table.
            let bits = _mm256_cvtepu16_epi32(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
            // SAFETY: every index is below 65,536 = `table.len()` (asserted above).
            let f = unsafe { _mm256_i32gather_ps::<4>(table.as_ptr(), bits) };
            let low = _mm256_cmp_ps::<_CMP_LE_OQ>(x, _mm256_set1_ps(-10.0));
            let high = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(10.0));
            let f = _mm256_blendv_ps(_mm256_blendv_ps(f, _mm256_setzero_ps(), low), x, high);
            // SAFETY: as for the loads.
            unsafe { _mm256_storeu_ps(gc.as_mut_ptr(), _mm256_mul_ps(f, u)) };
            done += 8;
        }
        done
    }

    /// [`super::swiglu`] over whole 8-lane groups; returns how many elements it did (it
    /// stops at a group whose exponent needs the f64 path of [`super::ggml_expf`]).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `gate.len() == up.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn swiglu(gate: &mut [f32], up: &[f32]) -> usize {
        let c = |bits: u32| _mm256_set1_ps(f32::from_bits(bits));
        let r = c(0x4B40_0000);
        let mut done = 0;
        for (gc, uc) in gate.chunks_exact_mut(8).zip(up.chunks_exact(8)) {
            // SAFETY: each chunk has 8 elements; unaligned loads and stores are allowed.
            let (x, u) = unsafe { (_mm256_loadu_ps(gc.as_ptr()), _mm256_loadu_ps(uc.as_ptr())) };
            let neg = _mm256_sub_ps(_mm256_setzero_ps(), x);
            let z = _mm256_fmadd_ps(neg, c(0x3FB8_AA3B), r);
            let n = _mm256_sub_ps(z, r);
            // Results below 2^-126 or above 2^127 take the scalar path.
            let big = _mm256_cmp_ps(
                _mm256_andnot_ps(_mm256_set1_ps(-0.0), n),
                _mm256_set1_ps(126.0),
                _CMP_GT_OQ,
            );
            if _mm256_movemask_ps(big) != 0 {
                break;
            }
            let b = _mm256_fnmadd_ps(n, c(0x35BF_BE8E), _mm256_fnmadd_ps(n, c(0x3F31_7200), neg));
            let uu = _mm256_mul_ps(b, b);
            let j = _mm256_fmadd_ps(
                _mm256_fmadd_ps(
                    _mm256_fmadd_ps(c(0x3C07_2010), b, c(0x3D2B_9F17)),
                    uu,
                    _mm256_fmadd_ps(c(0x3E2A_AF33), b, c(0x3EFF_FEDB)),
                ),
                uu,
                _mm256_fmadd_ps(c(0x3F7F_FFF6), b, _mm256_set1_ps(1.0)),
            );
            // 2^n as an f32 (|n| <= 126, so normal), then one rounding of j * 2^n.
            let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                23,
            ));
            let e = _mm256_mul_ps(j, pow2);
            let silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e));
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(gc.as_mut_ptr(), _mm256_mul_ps(silu, u)) };
            done += 8;
        }
        done
    }
}
