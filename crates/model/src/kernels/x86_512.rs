//! Register-tiled Q4_1 product for CPUs with AVX-512 VNNI. Prefill: a micro-tile of [`ROWS`]
//! weight rows × two tiles of 4 tokens (one at the end when the count is odd), two tokens per
//! 512-bit register (token `2k` in the low half, `2k + 1` in the high half). Each weight block
//! is unpacked once for eight tokens and each activation pair loaded once for [`ROWS`] rows.
//!
//! Every lane does exactly what the 256-bit kernels do for its token (the same `dpbusd`
//! sums, the same `d_w * d_a` product, the same fused multiply-add into the same lane, the
//! same `m_w * s_a` running sum and final reduction), so results are bit-identical to them,
//! and so to llama.cpp: the wider registers only run two tokens' lanes side by side.

use std::arch::x86_64::*;

use super::x86::{hsum, unpack_nibbles};
use super::TILE;
use crate::weights::{BlockQ4_1, BlockQ8_1};

/// Weight rows per micro-tile: 4 rows × 2 token pairs = 8 accumulators, well within the 32
/// vector registers.
pub const ROWS: usize = 4;

/// Whether this CPU runs [`q4_1_rows`].
pub fn available() -> bool {
    super::features().wide
}

/// `out[r * n + t] = dot(w[r], x[t])` for the `nr` rows of `w` (`nb` blocks each) and all
/// `n` tokens; `scales` are the tiles' [`super::tile_scales`] (empty when `n < TILE`).
/// Whole tiles of tokens go through [`micro_tile`].
///
/// # Safety
/// The CPU must support the features [`available`] checks. Slices are bounds-checked.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")]
pub unsafe fn q4_1_rows(
    w: &[BlockQ4_1],
    nb: usize,
    x: &[BlockQ8_1],
    scales: &[[f32; 2 * TILE]],
    n: usize,
    out: &mut [f32],
) {
    let nr = w.len() / nb;
    let tiles = if scales.len() >= n / TILE * nb {
        n / TILE
    } else {
        0
    };
    // Lane indices that spread tile scales [d0 d1 d2 d3] into [d0 x8, d1 x8] and [d2 x8, d3 x8].
    let pair01 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    let pair23 = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    let mut tile = 0;
    while tile < tiles {
        // Two tiles at once where there are two: each weight block is unpacked once for
        // eight tokens instead of four (the per-lane arithmetic is unchanged).
        if tile + 2 <= tiles {
            tile_pass::<2>(w, nb, nr, x, scales, n, tile, pair01, pair23, out);
            tile += 2;
        } else {
            tile_pass::<1>(w, nb, nr, x, scales, n, tile, pair01, pair23, out);
            tile += 1;
        }
    }
    // Tokens after the last whole tile: the 256-bit kernel, one row at a time (two rows
    // per 512-bit register measured slower here than this).
    let whole = tiles * TILE;
    let mut acts: [&[BlockQ8_1]; TILE] = [&[]; TILE];
    for (a, chunk) in acts.iter_mut().zip(x[whole * nb..n * nb].chunks_exact(nb)) {
        *a = chunk;
    }
    let k = n - whole;
    if k > 0 {
        for (r, row) in w.chunks_exact(nb).enumerate() {
            // SAFETY: AVX2 and FMA are among this function's features.
            unsafe {
                super::x86::vnni::q4_1(row, &acts[..k], None, &mut out[r * n + whole..(r + 1) * n])
            };
        }
    }
}

/// Every row against tiles `tile..tile + P` (`4P` tokens), `ROWS` rows at a time.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")]
fn tile_pass<const P: usize>(
    w: &[BlockQ4_1],
    nb: usize,
    nr: usize,
    x: &[BlockQ8_1],
    scales: &[[f32; 2 * TILE]],
    n: usize,
    tile: usize,
    pair01: __m512i,
    pair23: __m512i,
    out: &mut [f32],
) {
    let t0 = tile * TILE;
    let acts: [[&[BlockQ8_1]; TILE]; P] = std::array::from_fn(|p| {
        std::array::from_fn(|j| &x[(t0 + p * TILE + j) * nb..(t0 + p * TILE + j + 1) * nb])
    });
    let sc: [&[[f32; 2 * TILE]]; P] =
        std::array::from_fn(|p| &scales[(tile + p) * nb..(tile + p + 1) * nb]);
    let mut r = 0;
    while r + ROWS <= nr {
        let rows: [&[BlockQ4_1]; ROWS] =
            std::array::from_fn(|i| &w[(r + i) * nb..(r + i + 1) * nb]);
        let res = micro_tile::<ROWS, P>(rows, acts, sc, pair01, pair23);
        for (i, row) in res.iter().enumerate() {
            for (p, part) in row.iter().enumerate() {
                let at = (r + i) * n + t0 + p * TILE;
                out[at..at + TILE].copy_from_slice(part);
            }
        }
        r += ROWS;
    }
    while r < nr {
        let res = micro_tile::<1, P>([&w[r * nb..(r + 1) * nb]], acts, sc, pair01, pair23);
        for (p, part) in res[0].iter().enumerate() {
            let at = r * n + t0 + p * TILE;
            out[at..at + TILE].copy_from_slice(part);
        }
        r += 1;
    }
}

/// `R` rows against `P` whole tiles of 4 tokens: `[row][tile][token]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")]
fn micro_tile<const R: usize, const P: usize>(
    rows: [&[BlockQ4_1]; R],
    acts: [[&[BlockQ8_1]; TILE]; P],
    scales: [&[[f32; 2 * TILE]]; P],
    pair01: __m512i,
    pair23: __m512i,
) -> [[[f32; TILE]; P]; R] {
    let mut acc01 = [[_mm512_setzero_ps(); P]; R];
    let mut acc23 = [[_mm512_setzero_ps(); P]; R];
    let mut summs = [[_mm_setzero_ps(); P]; R];
    let zero = _mm512_setzero_si512();
    let nb = rows.first().map_or(0, |r| r.len());
    for i in 0..nb {
        let mut sv = [_mm_setzero_ps(); P];
        let mut a01 = [zero; P];
        let mut a23 = [zero; P];
        let mut da01 = [_mm512_setzero_ps(); P];
        let mut da23 = [_mm512_setzero_ps(); P];
        for p in 0..P {
            let sc = &scales[p][i];
            let acts = &acts[p];
            // SAFETY: `sc` is 8 readable f32 and each activation's `qs` 32 readable bytes;
            // unaligned loads are allowed.
            let dv = unsafe {
                let load = |a: &BlockQ8_1| _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                sv[p] = _mm_loadu_ps(sc.as_ptr().add(4));
                a01[p] = _mm512_inserti64x4(
                    _mm512_castsi256_si512(load(&acts[0][i])),
                    load(&acts[1][i]),
                    1,
                );
                a23[p] = _mm512_inserti64x4(
                    _mm512_castsi256_si512(load(&acts[2][i])),
                    load(&acts[3][i]),
                    1,
                );
                _mm512_castps128_ps512(_mm_loadu_ps(sc.as_ptr()))
            };
            da01[p] = _mm512_permutexvar_ps(pair01, dv);
            da23[p] = _mm512_permutexvar_ps(pair23, dv);
        }
        for r in 0..R {
            let wb = &rows[r][i];
            let wq = _mm512_broadcast_i64x4(unpack_nibbles(&wb.qs));
            let dw = _mm512_set1_ps(wb.d);
            let m = _mm_set1_ps(wb.m);
            for p in 0..P {
                summs[r][p] = _mm_add_ps(summs[r][p], _mm_mul_ps(m, sv[p]));
                let p01 = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, wq, a01[p]));
                let p23 = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, wq, a23[p]));
                acc01[r][p] = _mm512_fmadd_ps(_mm512_mul_ps(dw, da01[p]), p01, acc01[r][p]);
                acc23[r][p] = _mm512_fmadd_ps(_mm512_mul_ps(dw, da23[p]), p23, acc23[r][p]);
            }
        }
    }
    let mut out = [[[0f32; TILE]; P]; R];
    for r in 0..R {
        for p in 0..P {
            let mut s = [0f32; TILE];
            // SAFETY: `s` is 4 writable f32.
            unsafe { _mm_storeu_ps(s.as_mut_ptr(), summs[r][p]) };
            let halves = [
                _mm512_castps512_ps256(acc01[r][p]),
                _mm512_extractf32x8_ps(acc01[r][p], 1),
                _mm512_castps512_ps256(acc23[r][p]),
                _mm512_extractf32x8_ps(acc23[r][p], 1),
            ];
            for t in 0..TILE {
                out[r][p][t] = hsum(halves[t]) + s[t];
            }
        }
    }
    out
}
