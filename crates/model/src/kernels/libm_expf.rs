//! `expf` with exactly the bits of the C library's, many lanes at a time.
//!
//! llama.cpp's CPU flash attention calls the C library's scalar `expf` once per key and
//! head, and our attention reproduces its output bit for bit, so it must get the same
//! values. Called one at a time, `expf` was about a third of attention's time. glibc's
//! `expf` (the algorithm of Arm's optimized-routines: `x * 32 / ln 2` split into an integer
//! and a remainder, a table of `2^(i/32)`, a cubic in double precision, one rounding to
//! f32) is a fixed sequence of double-precision operations, so the same sequence on vector
//! lanes gives the same bits. The sequence here is the one of glibc's FMA build (the one
//! its dispatcher picks on every CPU with AVX2), which fuses four of the multiply-adds.
//!
//! This is checked, not assumed: [`vector_matches_libm`] compares the vector paths with
//! the linked `expf` on first use (over inputs spanning every exponent the attention can
//! produce, and the special values), and the batch function falls back to the scalar
//! library call where they differ, as on a C library with another `expf`. A test compares
//! every non-positive f32 exhaustively.

/// Bits of `2^(i/32)` for `i` in `0..32`, rounded to nearest.
const EXP2_TABLE: [u64; 32] = [
    0x3ff0000000000000,
    0x3ff059b0d3158574,
    0x3ff0b5586cf9890f,
    0x3ff11301d0125b51,
    0x3ff172b83c7d517b,
    0x3ff1d4873168b9aa,
    0x3ff2387a6e756238,
    0x3ff29e9df51fdee1,
    0x3ff306fe0a31b715,
    0x3ff371a7373aa9cb,
    0x3ff3dea64c123422,
    0x3ff44e086061892d,
    0x3ff4bfdad5362a27,
    0x3ff5342b569d4f82,
    0x3ff5ab07dd485429,
    0x3ff6247eb03a5585,
    0x3ff6a09e667f3bcd,
    0x3ff71f75e8ec5f74,
    0x3ff7a11473eb0187,
    0x3ff82589994cce13,
    0x3ff8ace5422aa0db,
    0x3ff93737b0cdc5e5,
    0x3ff9c49182a3f090,
    0x3ffa5503b23e255d,
    0x3ffae89f995ad3ad,
    0x3ffb7f76f2fb5e47,
    0x3ffc199bdd85529c,
    0x3ffcb720dcef9069,
    0x3ffd5818dcfba487,
    0x3ffdfc97337b9b5f,
    0x3ffea4afa2a490da,
    0x3fff50765b6e4540,
];

/// `32 / ln 2`.
const INV_LN2_N: f64 = f64::from_bits(0x40471547652b82fe);
/// `1.5 * 2^52`: adding it rounds to an integer held in the low mantissa bits.
const SHIFT: f64 = f64::from_bits(0x4338000000000000);
/// The cubic `C0 r^3 + C1 r^2 + C2 r + 1` approximating `2^(r/32)`.
const C0: f64 = f64::from_bits(0x3ebc6af84b912394);
const C1: f64 = f64::from_bits(0x3f2ebfce50fac4f3);
const C2: f64 = f64::from_bits(0x3f962e42ff0c52d6);

/// Inputs whose top 12 bits (sign cleared) reach this (|x| ≥ 88, infinities, NaN) take the
/// library's special-case branch; the vector paths hand those lanes to the library itself.
const SPECIAL_TOP12: u32 = 0x42b;

/// The table with `i << 47` taken off entry `i`, as the C code keeps it: adding `ki << 47`
/// back (wrapping) restores the entry and carries `ki div 32` into the exponent.
const TABLE_MINUS_INDEX: [u64; 32] = {
    let mut t = [0u64; 32];
    let mut i = 0;
    while i < 32 {
        t[i] = EXP2_TABLE[i].wrapping_sub((i as u64) << 47);
        i += 1;
    }
    t
};

/// The library's non-special path on one lane, in portable Rust: the reference the vector
/// paths are tested against, and the fallback where the CPU has neither.
pub fn expf_fast_path(x: f32) -> f32 {
    let xd = x as f64;
    let kd_shifted = INV_LN2_N.mul_add(xd, SHIFT);
    let ki = kd_shifted.to_bits();
    let kd = kd_shifted - SHIFT;
    let r = INV_LN2_N.mul_add(xd, -kd);
    let s = f64::from_bits(TABLE_MINUS_INDEX[(ki % 32) as usize].wrapping_add(ki << 47));
    let z = r.mul_add(C0, C1);
    let r2 = r * r;
    let y = r.mul_add(C2, 1.0);
    let y = z.mul_add(r2, y);
    (y * s) as f32
}

fn is_special(x: f32) -> bool {
    (x.to_bits() >> 20) & 0x7ff >= SPECIAL_TOP12
}

/// `xs[i] = expf(xs[i])` with the C library's bits.
pub fn expf_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if vector_matches_libm() {
        let f = super::cpu::features();
        if f.wide {
            // SAFETY: AVX-512 F and DQ are present (checked).
            unsafe { x86::expf_512(xs) };
            return;
        }
        if f.avx2 {
            // SAFETY: AVX2 and FMA are present (checked).
            unsafe { x86::expf_256(xs) };
            return;
        }
    }
    for x in xs.iter_mut() {
        *x = x.exp();
    }
}

/// Whether the vector paths give the linked `expf`'s bits, decided once.
#[cfg(target_arch = "x86_64")]
pub fn vector_matches_libm() -> bool {
    static MATCHES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *MATCHES.get_or_init(|| {
        let probes = probe_inputs();
        let mut got = probes.clone();
        let f = super::cpu::features();
        if f.wide {
            // SAFETY: AVX-512 F and DQ are present (checked).
            unsafe { x86::expf_512(&mut got) };
        } else if f.avx2 {
            // SAFETY: AVX2 and FMA are present (checked).
            unsafe { x86::expf_256(&mut got) };
        } else {
            return false;
        }
        probes
            .iter()
            .zip(&got)
            .all(|(x, g)| x.exp().to_bits() == g.to_bits())
    })
}

/// Inputs for the run-time check: every 9,973rd f32 from -110 to 0 (every exponent, about
/// 112,000 values), positives up to the overflow bound, and the special values.
pub fn probe_inputs() -> Vec<f32> {
    let mut v: Vec<f32> = (0x8000_0000u32..=0xc2dc_0000)
        .step_by(9_973)
        .map(f32::from_bits)
        .collect();
    v.extend((0u32..=0x42b2_0000).step_by(99_991).map(f32::from_bits));
    v.extend([
        f32::NEG_INFINITY,
        f32::INFINITY,
        f32::NAN,
        -0.0,
        0.0,
        -88.0,
        88.0,
        -103.5,
        -104.0,
        89.0,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
    ]);
    v
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    use super::{is_special, C0, C1, C2, INV_LN2_N, SHIFT, SPECIAL_TOP12, TABLE_MINUS_INDEX};

    /// Four lanes of the fast path in doubles.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn four(x: __m128) -> __m128 {
        let xd = _mm256_cvtps_pd(x);
        let inv = _mm256_set1_pd(INV_LN2_N);
        let shift = _mm256_set1_pd(SHIFT);
        let kd_shifted = _mm256_fmadd_pd(inv, xd, shift);
        let ki = _mm256_castpd_si256(kd_shifted);
        let kd = _mm256_sub_pd(kd_shifted, shift);
        let r = _mm256_fmsub_pd(inv, xd, kd);
        let idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        // SAFETY: every index is masked to 0..32, inside the 32-entry table.
        let t =
            unsafe { _mm256_i64gather_epi64::<8>(TABLE_MINUS_INDEX.as_ptr() as *const i64, idx) };
        let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
        let z = _mm256_fmadd_pd(r, _mm256_set1_pd(C0), _mm256_set1_pd(C1));
        let r2 = _mm256_mul_pd(r, r);
        let y = _mm256_fmadd_pd(r, _mm256_set1_pd(C2), _mm256_set1_pd(1.0));
        let y = _mm256_fmadd_pd(z, r2, y);
        _mm256_cvtpd_ps(_mm256_mul_pd(y, s))
    }

    /// [`super::expf_in_place`] eight lanes at a time; a group of eight with a special
    /// input goes to the library lane by lane.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn expf_256(xs: &mut [f32]) {
        let mut chunks = xs.chunks_exact_mut(8);
        for c in &mut chunks {
            // SAFETY: the chunk is 8 f32; unaligned loads and stores are allowed.
            let x = unsafe { _mm256_loadu_ps(c.as_ptr()) };
            let top = _mm256_and_si256(
                _mm256_srli_epi32::<20>(_mm256_castps_si256(x)),
                _mm256_set1_epi32(0x7ff),
            );
            let special = _mm256_cmpgt_epi32(top, _mm256_set1_epi32(SPECIAL_TOP12 as i32 - 1));
            if _mm256_movemask_epi8(special) != 0 {
                for v in c.iter_mut() {
                    *v = v.exp();
                }
                continue;
            }
            let lo = four(_mm256_castps256_ps128(x));
            let hi = four(_mm256_extractf128_ps::<1>(x));
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(c.as_mut_ptr(), _mm256_set_m128(hi, lo)) };
        }
        for v in chunks.into_remainder() {
            *v = if is_special(*v) {
                v.exp()
            } else {
                super::expf_fast_path(*v)
            };
        }
    }

    /// Eight lanes of the fast path in doubles, the table in four registers of 8 entries.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    fn eight(x: __m256, table: &[__m512i; 4]) -> __m256 {
        let xd = _mm512_cvtps_pd(x);
        let inv = _mm512_set1_pd(INV_LN2_N);
        let shift = _mm512_set1_pd(SHIFT);
        let kd_shifted = _mm512_fmadd_pd(inv, xd, shift);
        let ki = _mm512_castpd_si512(kd_shifted);
        let kd = _mm512_sub_pd(kd_shifted, shift);
        let r = _mm512_fmsub_pd(inv, xd, kd);
        // `permutex2var` picks an entry with index bits 0..3 from two registers (bit 3
        // chooses the register); index bit 4 chooses between the two pairs.
        let low_half = _mm512_permutex2var_epi64(table[0], ki, table[1]);
        let high_half = _mm512_permutex2var_epi64(table[2], ki, table[3]);
        let upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
        let t = _mm512_mask_blend_epi64(upper, low_half, high_half);
        let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
        let z = _mm512_fmadd_pd(r, _mm512_set1_pd(C0), _mm512_set1_pd(C1));
        let r2 = _mm512_mul_pd(r, r);
        let y = _mm512_fmadd_pd(r, _mm512_set1_pd(C2), _mm512_set1_pd(1.0));
        let y = _mm512_fmadd_pd(z, r2, y);
        _mm512_cvtpd_ps(_mm512_mul_pd(y, s))
    }

    /// [`super::expf_in_place`] sixteen lanes at a time, the rest as [`expf_256`].
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and DQ, AVX2 and FMA.
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
    pub unsafe fn expf_512(xs: &mut [f32]) {
        let mut table = [_mm512_setzero_si512(); 4];
        for (i, t) in table.iter_mut().enumerate() {
            // SAFETY: entries 8i..8i+8 lie inside the 32-entry table; unaligned loads are
            // allowed.
            *t = unsafe {
                _mm512_loadu_si512(TABLE_MINUS_INDEX.as_ptr().add(8 * i) as *const __m512i)
            };
        }
        let mut chunks = xs.chunks_exact_mut(16);
        for c in &mut chunks {
            // SAFETY: the chunk is 16 f32; unaligned loads and stores are allowed.
            let x = unsafe { _mm512_loadu_ps(c.as_ptr()) };
            let top = _mm512_and_si512(
                _mm512_srli_epi32::<20>(_mm512_castps_si512(x)),
                _mm512_set1_epi32(0x7ff),
            );
            if _mm512_cmpge_epi32_mask(top, _mm512_set1_epi32(SPECIAL_TOP12 as i32)) != 0 {
                for v in c.iter_mut() {
                    *v = v.exp();
                }
                continue;
            }
            let lo = eight(_mm512_castps512_ps256(x), &table);
            let hi = eight(_mm512_extractf32x8_ps::<1>(x), &table);
            let both = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(lo), hi);
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(c.as_mut_ptr(), both) };
        }
        // SAFETY: AVX2 and FMA are present (the caller's contract).
        unsafe { expf_256(chunks.into_remainder()) };
    }
}

#[cfg(test)]
mod tests {
    use rayon::prelude::*;

    use super::*;

    /// Every non-positive f32 (the attention's arguments are `s - max` and `old - new`),
    /// NaNs included, through the batch function in groups of 16 and of 13 (so the
    /// 256-bit path and the scalar remainder run too), against the linked library's.
    #[test]
    fn batch_expf_gives_the_c_librarys_bits_for_every_non_positive_input() {
        #[cfg(target_arch = "x86_64")]
        assert!(
            !super::super::cpu::features().avx2 || vector_matches_libm(),
            "the vector expf differs from this C library's: attention falls back to the \
             scalar call, correct but slower"
        );
        let bad: u64 = (0x8000u32..=0xffff)
            .into_par_iter()
            .map(|hi| {
                let mut mismatches = 0u64;
                let mut xs = [0f32; 16 * 64];
                for base in (0..0x1_0000u32).step_by(xs.len()) {
                    for (i, x) in xs.iter_mut().enumerate() {
                        *x = f32::from_bits(hi << 16 | (base + i as u32));
                    }
                    let mut got = xs;
                    let (a, b) = got.split_at_mut(13 * 40);
                    for c in a.chunks_mut(13) {
                        expf_in_place(c);
                    }
                    expf_in_place(b);
                    for (x, g) in xs.iter().zip(&got) {
                        let want = x.exp();
                        if want.to_bits() != g.to_bits() && !(want.is_nan() && g.is_nan()) {
                            mismatches += 1;
                        }
                    }
                }
                mismatches
            })
            .sum();
        assert_eq!(bad, 0, "inputs whose expf differs from the C library's");
    }

    /// Positive inputs, sampled: the attention never passes one, but the function is
    /// general.
    #[test]
    fn batch_expf_matches_on_positive_inputs() {
        let xs: Vec<f32> = (0u32..0x7f80_0000)
            .step_by(1_009)
            .map(f32::from_bits)
            .collect();
        let mut got = xs.clone();
        expf_in_place(&mut got);
        for (x, g) in xs.iter().zip(&got) {
            assert_eq!(x.exp().to_bits(), g.to_bits(), "expf({x})");
        }
        for x in probe_inputs() {
            if !is_special(x) {
                assert_eq!(expf_fast_path(x).to_bits(), x.exp().to_bits(), "expf({x})");
            }
        }
    }
}
