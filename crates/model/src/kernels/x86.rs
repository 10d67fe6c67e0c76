//! x86 building blocks of the quantized kernels (256-bit lanes), compiled once per
//! instruction set by `quant_kernels!`.

use std::arch::x86_64::*;

use crate::blocks::BlockQ8_1;

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn load_act(a: &BlockQ8_1) -> __m256i {
    // SAFETY: `qs` is 32 readable bytes; `loadu` has no alignment requirement.
    unsafe { _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i) }
}

/// The 32 nibbles of a 4-bit block as bytes, in element order (low nibbles are elements
/// 0..16, high nibbles 16..32).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn unpack_nibbles(qs: &[u8; 16]) -> __m256i {
    // SAFETY: `qs` is 16 readable bytes; `loadu` has no alignment requirement.
    let q = unsafe { _mm_loadu_si128(qs.as_ptr() as *const __m128i) };
    let mask = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(q, mask);
    let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    _mm256_set_m128i(hi, lo)
}

/// Bytes ahead of the weights being read that [`prefetch_ahead`] asks for (2 KiB: on a
/// 2-core Xeon 0.5 KiB gave 16.6 decode tokens/s on a Llama-3.2-1B-shaped Q4_K file, 1 to
/// 4 KiB 18.3 to 19.1, none 11.3).
const PREFETCH_DISTANCE: usize = 2048;

/// Asks for the weights [`PREFETCH_DISTANCE`] bytes past `at` (the row's next blocks,
/// then the next rows', which follow in memory): a decode step streams every weight once,
/// and with the hardware prefetcher alone each core waited on its loads.
#[inline(always)]
pub(super) fn prefetch_ahead<T>(at: &T) {
    let ahead = (at as *const T)
        .cast::<i8>()
        .wrapping_add(PREFETCH_DISTANCE);
    // SAFETY: a prefetch is a hint: it never faults and makes nothing visible to the
    // program, whatever the address (`wrapping_add` forms it without claiming it is in
    // bounds). The second line covers the rest of a block longer than 64 bytes.
    unsafe {
        _mm_prefetch::<_MM_HINT_T0>(ahead);
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64));
    }
}

/// The quantized dot-product kernels, compiled once per instruction set. Only the
/// byte-product step differs (`maddubs` + `madd` on AVX2, one `dpbusd` with VNNI); both
/// give the same exact i32 sums, so the two builds agree bit for bit.
macro_rules! quant_kernels {
    ($module:ident, $features:literal, $doc:literal) => {
        #[doc = $doc]
        pub mod $module {
            use std::arch::x86_64::*;

            use super::{hsum, load_act, prefetch_ahead, unpack_nibbles};
            use crate::blocks::{BlockQ4_1, BlockQ8_1};

            /// Sums of products of 32 unsigned bytes (0..=128) with 32 signed bytes, as
            /// 8 i32 lanes converted to f32. `maddubs` cannot saturate here:
            /// 2 * 128 * 127 < 32767.
            #[inline]
            #[target_feature(enable = $features)]
            fn dot_u8_i8(u: __m256i, s: __m256i) -> __m256 {
                quant_kernels!(@dot $module, u, s)
            }

            /// A tile of `N` activation rows against one weight row, unrolled for `N`.
            #[inline]
            #[target_feature(enable = $features)]
            fn q4_1_n<const N: usize>(w: &[BlockQ4_1], acts: [&[BlockQ8_1]; N], out: &mut [f32]) {
                let mut acc = [_mm256_setzero_ps(); N];
                let mut summs = [0f32; N];
                for (i, wb) in w.iter().enumerate() {
                    prefetch_ahead(wb);
                    let wq = unpack_nibbles(&wb.qs);
                    for t in 0..N {
                        let ab = &acts[t][i];
                        summs[t] += wb.m * ab.s;
                        let xy = dot_u8_i8(wq, load_act(ab));
                        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(wb.d * ab.d), xy, acc[t]);
                    }
                }
                for t in 0..N {
                    out[t] = hsum(acc[t]) + summs[t];
                }
            }

            /// `R` weight rows × a whole tile of 4 tokens with their scales gathered
            /// ([`crate::kernels::tile_scales`]): the four `d_w * d_a` and `m_w * s_a`
            /// products are one vector multiply each, lane for lane the scalar products of
            /// [`q4_1_n`]; each activation block is loaded once for the `R` rows.
            #[inline]
            #[target_feature(enable = $features)]
            fn q4_1_scaled<const R: usize>(w: [&[BlockQ4_1]; R], acts: [&[BlockQ8_1]; 4], scales: &[[f32; 8]]) -> [[f32; 4]; R] {
                let mut acc = [[_mm256_setzero_ps(); 4]; R];
                let mut summs = [_mm_setzero_ps(); R];
                let lane = [
                    _mm256_set1_epi32(0),
                    _mm256_set1_epi32(1),
                    _mm256_set1_epi32(2),
                    _mm256_set1_epi32(3),
                ];
                for (i, sc) in scales.iter().enumerate() {
                    // SAFETY: `sc` is 8 readable f32; unaligned loads are allowed.
                    let (dv, sv) = unsafe { (_mm_loadu_ps(sc.as_ptr()), _mm_loadu_ps(sc.as_ptr().add(4))) };
                    let mut dd = [_mm256_setzero_ps(); R];
                    let mut wq = [_mm256_setzero_si256(); R];
                    for r in 0..R {
                        let wb = &w[r][i];
                        summs[r] = _mm_add_ps(summs[r], _mm_mul_ps(_mm_set1_ps(wb.m), sv));
                        let d = _mm_mul_ps(_mm_set1_ps(wb.d), dv);
                        dd[r] = _mm256_set_m128(d, d);
                        wq[r] = unpack_nibbles(&wb.qs);
                    }
                    for t in 0..4 {
                        let a = load_act(&acts[t][i]);
                        for r in 0..R {
                            let xy = dot_u8_i8(wq[r], a);
                            acc[r][t] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(dd[r], lane[t]), xy, acc[r][t]);
                        }
                    }
                }
                let mut out = [[0f32; 4]; R];
                for r in 0..R {
                    let mut s = [0f32; 4];
                    // SAFETY: `s` is 4 writable f32.
                    unsafe { _mm_storeu_ps(s.as_mut_ptr(), summs[r]) };
                    for t in 0..4 {
                        out[r][t] = hsum(acc[r][t]) + s[t];
                    }
                }
                out
            }

            /// # Safety
            /// The CPU must support the features this module is compiled for.
            #[target_feature(enable = $features)]
            pub unsafe fn q4_1(w: &[BlockQ4_1], acts: &[&[BlockQ8_1]], scales: Option<&[[f32; 8]]>, out: &mut [f32]) {
                match (acts, scales) {
                    (&[a, b, c, d], Some(sc)) if sc.len() == w.len() => {
                        out[..4].copy_from_slice(&q4_1_scaled::<1>([w], [a, b, c, d], sc)[0]);
                    }
                    // SAFETY: same features as this function, the only requirement.
                    _ => unsafe { q4_1_tile(w, acts, out) },
                }
            }

            quant_kernels!(@entry q4_1_tile, q4_1_n, BlockQ4_1, $features);

            /// Every row of `w` (`nb` blocks each) against every token of `x`, in tiles:
            /// `out[r * n + t]`. `scales` are the tiles' gathered scales (or empty). One call
            /// per product, so the tile kernels inline instead of being dispatched per row.
            ///
            /// # Safety
            /// The CPU must support the features this module is compiled for.
            #[target_feature(enable = $features)]
            pub unsafe fn q4_1_rows(w: &[BlockQ4_1], nb: usize, x: &[BlockQ8_1], scales: &[[f32; 8]], n: usize, out: &mut [f32]) {
                let nr = w.len() / nb;
                let row = |r: usize| &w[r * nb..(r + 1) * nb];
                let tiles = if scales.len() >= n / 4 * nb { n / 4 } else { 0 };
                for tile in 0..tiles {
                    let t0 = tile * 4;
                    let acts: [&[BlockQ8_1]; 4] = std::array::from_fn(|j| &x[(t0 + j) * nb..(t0 + j + 1) * nb]);
                    let sc = &scales[tile * nb..(tile + 1) * nb];
                    let mut r = 0;
                    while r + 2 <= nr {
                        let res = q4_1_scaled::<2>([row(r), row(r + 1)], acts, sc);
                        for (i, v) in res.iter().enumerate() {
                            out[(r + i) * n + t0..(r + i) * n + t0 + 4].copy_from_slice(v);
                        }
                        r += 2;
                    }
                    if r < nr {
                        let res = q4_1_scaled::<1>([row(r)], acts, sc);
                        out[r * n + t0..r * n + t0 + 4].copy_from_slice(&res[0]);
                    }
                }
                let whole = tiles * 4;
                let mut acts: [&[BlockQ8_1]; 4] = [&[]; 4];
                for (a, chunk) in acts.iter_mut().zip(x[whole * nb..n * nb].chunks_exact(nb)) {
                    *a = chunk;
                }
                let k = n - whole;
                if k > 0 {
                    for r in 0..nr {
                        // SAFETY: same features as this function, the only requirement.
                        unsafe { q4_1_tile(row(r), &acts[..k], &mut out[r * n + whole..(r + 1) * n]) };
                    }
                }
            }
        }
    };
    // Every row against every token, in tiles (see `q4_1_rows`).
    (@rows $name:ident, $entry:ident, $wt:ty, $features:literal) => {
        /// # Safety
        /// The CPU must support the features this module is compiled for.
        #[target_feature(enable = $features)]
        pub unsafe fn $name(w: &[$wt], nb: usize, x: &[BlockQ8_1], n: usize, out: &mut [f32]) {
            let mut acts: [&[BlockQ8_1]; 4] = [&[]; 4];
            for (r, row) in w.chunks_exact(nb).enumerate() {
                let mut t = 0;
                while t < n {
                    let k = (n - t).min(4);
                    for (j, a) in acts.iter_mut().enumerate().take(k) {
                        *a = &x[(t + j) * nb..(t + j + 1) * nb];
                    }
                    // SAFETY: same features as this function, the only requirement.
                    unsafe { $entry(row, &acts[..k], &mut out[r * n + t..r * n + t + k]) };
                    t += k;
                }
            }
        }
    };
    // The public entry: the tile's size picks a fully unrolled instance.
    (@entry $name:ident, $tile:ident, $wt:ty, $features:literal) => {
        /// # Safety
        /// The CPU must support the features this module is compiled for.
        #[target_feature(enable = $features)]
        pub unsafe fn $name(w: &[$wt], acts: &[&[BlockQ8_1]], out: &mut [f32]) {
            match *acts {
                [a, b, c, d, ..] => $tile::<4>(w, [a, b, c, d], out),
                [a, b, c] => $tile::<3>(w, [a, b, c], out),
                [a, b] => $tile::<2>(w, [a, b], out),
                [a] => $tile::<1>(w, [a], out),
                [] => {}
            }
        }
    };
    (@dot avx2, $u:ident, $s:ident) => {{
        let p16 = _mm256_maddubs_epi16($u, $s);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)))
    }};
    (@dot vnni, $u:ident, $s:ident) => {
        _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), $u, $s))
    };
}

quant_kernels!(avx2, "avx2,fma", "Kernels for AVX2 with FMA.");
quant_kernels!(
    vnni,
    "avx2,fma,avx512vnni,avx512vl",
    "Kernels for CPUs with AVX-512 VNNI (Zen 4, Sapphire Rapids and later)."
);
