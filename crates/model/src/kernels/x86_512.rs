//! Register-tiled Q4_1, Q8_0, Q4_0, Q5_0 and Q5_1 products for CPUs with AVX-512 VNNI, two
//! tokens per 512-bit register (token `2k` in the low half, `2k + 1` in the high half).
//! Prefill: Q4_1 as a micro-tile of [`ROWS`] weight rows × two tiles of 4 tokens (one at the
//! end when the count is odd), each weight block unpacked once for eight tokens and each
//! activation pair loaded once for [`ROWS`] rows; Q8_0 and Q4_0 as [`ROWS_Q8_Q5`] rows × one
//! tile,
//! Q5_0 and Q5_1 as half as many rows × two tiles (one tile at the end, with all the rows),
//! each activation pair loaded once for all the micro-tile's rows.
//!
//! Every lane does exactly what the 256-bit kernels do for its token (the same `dpbusd`
//! sums, the same `d_w * d_a` product, the same fused multiply-add into the same lane, the
//! same `m_w * s_a` running sum and final reduction), so results are bit-identical to them,
//! and so to llama.cpp: the wider registers only run two tokens' lanes side by side.
//!
//! Q8_0, Q4_0 and Q5_0 have signed weights, which `dpbusd` (unsigned × signed bytes) cannot
//! take directly. Instead of the 256-bit kernels' sign trick (one extra instruction per row
//! and token pair), the weights go in unsigned with an offset (`w + 128`, or Q4_0's and
//! Q5_0's raw `q` for `q - 8` and `q - 16`), and each lane starts from minus the offset times its four activations'
//! sum, computed once per token pair for all rows. Integer sums are exact, so each lane
//! ends on exactly the 256-bit kernel's `i32` (for activations in -127..=127, which is what
//! Q8_1 quantization gives and what the sign trick needs as well).

use std::arch::x86_64::*;

use super::x86::{hsum, unpack_nibbles};
use super::TILE;
use crate::weights::{BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1};

/// Weight rows per micro-tile: 4 rows × 2 token pairs = 8 accumulators, well within the 32
/// vector registers.
pub const ROWS: usize = 4;

/// Weight rows per one-tile micro-tile of the Q8_0, Q5_0 and Q5_1 kernels (half as many
/// for Q5's two-tile passes): 8 rows × 2 token pairs = 16 accumulators, with the pairs'
/// activations, offsets and scales still within the 32 registers. On Zen 4 (512-bit
/// operations split in two) 8 rows gave Q8_0 prefill ~8% and the Q5_0 kernel ~13% over 4,
/// by sharing each activation pair's loads, offsets and scales more widely; Q5's unpacking
/// costs more than Q8_0's, so there two tiles × 4 rows did a little better again.
pub const ROWS_Q8_Q5: usize = 8;

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
    let mut tile = 0;
    while tile < tiles {
        // Two tiles at once where there are two: each weight block is unpacked once for
        // eight tokens instead of four (the per-lane arithmetic is unchanged).
        if tile + 2 <= tiles {
            tile_pass::<2>(w, nb, nr, x, scales, n, tile, out);
            tile += 2;
        } else {
            tile_pass::<1>(w, nb, nr, x, scales, n, tile, out);
            tile += 1;
        }
    }
    // Tokens after the last whole tile: the 256-bit kernel, one row at a time (two rows
    // per 512-bit register measured slower here than this).
    let whole = tiles * TILE;
    let acts = leftover_tokens(x, nb, whole, n);
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
        let res = micro_tile::<ROWS, P>(rows, acts, sc);
        for (i, row) in res.iter().enumerate() {
            for (p, part) in row.iter().enumerate() {
                let at = (r + i) * n + t0 + p * TILE;
                out[at..at + TILE].copy_from_slice(part);
            }
        }
        r += ROWS;
    }
    while r < nr {
        let res = micro_tile::<1, P>([&w[r * nb..(r + 1) * nb]], acts, sc);
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
) -> [[[f32; TILE]; P]; R] {
    let mut acc = [[_mm512_setzero_ps(); PAIRS]; R];
    let mut summs = [_mm256_setzero_ps(); R];
    let zero = _mm512_setzero_si512();
    let nb = rows.first().map_or(0, |r| r.len());
    let mask = _mm512_set1_epi8(0x0f);
    let shifts = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
    for i in 0..nb {
        let mut a = [zero; PAIRS];
        for p in 0..P {
            (a[2 * p], a[2 * p + 1]) = act_pairs(&acts[p], i);
        }
        let (d, _) = tile_pair_scales::<P>(&scales, i);
        for (row, acc) in rows.iter().zip(acc.iter_mut()) {
            let wb = &row[i];
            // SAFETY: `qs` is 16 readable bytes; the load is unaligned.
            let q = unsafe { _mm512_broadcast_i32x4(_mm_loadu_si128(wb.qs.as_ptr().cast())) };
            // Low nibbles (elements 0..16) in each half's low 128 bits, high ones above.
            let wq = _mm512_and_si512(_mm512_srlv_epi64(q, shifts), mask);
            let products = _mm512_mul_ps(_mm512_set1_ps(wb.d), d);
            for k in 0..2 * P {
                let sums = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, wq, a[k]));
                acc[k] = _mm512_fmadd_ps(pair_products(products, k), sums, acc[k]);
            }
        }
    }
    // The minimums' running sums apart from the products: the same additions in the same
    // order, without holding `R` more registers through the loop above.
    for i in 0..nb {
        let (_, s) = tile_pair_scales::<P>(&scales, i);
        for (row, summs) in rows.iter().zip(summs.iter_mut()) {
            *summs = _mm256_add_ps(*summs, _mm256_mul_ps(_mm256_set1_ps(row[i].m), s));
        }
    }
    let mut out = [[[0f32; TILE]; P]; R];
    for r in 0..R {
        let mut all = [0f32; 2 * TILE];
        // SAFETY: `all` is 8 writable f32.
        unsafe { _mm256_storeu_ps(all.as_mut_ptr(), reduce_pairs::<P>(&acc[r], Some(summs[r]))) };
        for p in 0..P {
            out[r][p].copy_from_slice(&all[p * TILE..(p + 1) * TILE]);
        }
    }
    out
}

/// The `4P` tokens' results of `2P` pair accumulators `[t_2k | t_2k+1]`, in token order
/// (lanes past `4P` undefined): each token's eight lanes reduced exactly as the 256-bit
/// kernels' `hsum` reduces them (high half plus low half, then lanes 0+2 and 1+3, then
/// those two), plus that token's minimum sum where there is one. The same additions on the
/// same operands, done for eight tokens at once by shuffling them side by side.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")]
fn reduce_pairs<const P: usize>(acc: &[__m512; PAIRS], summs: Option<__m256>) -> __m256 {
    // Quarters `[t.lo, t.hi]` of each token: lows of tokens 0..4 against their highs.
    let halves = |a: __m512, b: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        )
    };
    let first = halves(acc[0], acc[1]);
    let second = if P == 2 {
        halves(acc[2], acc[3])
    } else {
        first
    };
    // Per 128-bit lane j: [r0 + r2, r1 + r3] of token j, then of token j + 4.
    let pairs = _mm512_add_ps(
        _mm512_shuffle_ps::<0b01_00_01_00>(first, second),
        _mm512_shuffle_ps::<0b11_10_11_10>(first, second),
    );
    // Per lane j: token j's sum, then token j + 4's, twice.
    let sums = _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(pairs, pairs),
        _mm512_shuffle_ps::<0b11_01_11_01>(pairs, pairs),
    );
    let in_order = _mm512_castps512_ps256(_mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0),
        sums,
    ));
    match summs {
        Some(m) => _mm256_add_ps(in_order, m),
        None => in_order,
    }
}

/// Token pairs of the widest pass (two tiles).
const PAIRS: usize = 2 * 2;

/// Block `i`'s activation scales of `P` tiles (tokens `0..4P`), laid out for
/// [`pair_products`] as `[d0 d2 d4 d6, d0 d2 d4 d6, d1 d3 d5 d7, d1 d3 d5 d7]`, and their
/// `s` in token order. One multiply by `d_w` then gives every token pair's `d_w * d_a`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")]
fn tile_pair_scales<const P: usize>(
    scales: &[&[[f32; 2 * TILE]]; P],
    i: usize,
) -> (__m512, __m256) {
    let first = &scales[0][i];
    // SAFETY: each entry is 8 readable f32 (`d` of the tile's 4 tokens, then `s`).
    let (d, s) = unsafe {
        let d0 = _mm_loadu_ps(first.as_ptr());
        let s0 = _mm_loadu_ps(first.as_ptr().add(TILE));
        if P == 2 {
            let second = &scales[P - 1][i];
            let d1 = _mm_loadu_ps(second.as_ptr());
            let s1 = _mm_loadu_ps(second.as_ptr().add(TILE));
            (_mm256_set_m128(d1, d0), _mm256_set_m128(s1, s0))
        } else {
            (_mm256_castps128_ps256(d0), _mm256_castps128_ps256(s0))
        }
    };
    let by_pair = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 1, 3, 5, 7, 1, 3, 5, 7);
    (_mm512_permutexvar_ps(by_pair, _mm512_castps256_ps512(d)), s)
}

/// Token pair `k`'s products `[p_2k x8, p_2k+1 x8]` out of a [`tile_pair_scales`] layout
/// times `d_w`: one in-lane shuffle, which runs beside the multiply-adds (on Zen 5 a
/// separate multiply per pair held the tile at 1.5 cycles a pair, the shuffle at 1.05).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")]
fn pair_products(products: __m512, k: usize) -> __m512 {
    match k {
        0 => _mm512_shuffle_ps::<0x00>(products, products),
        1 => _mm512_shuffle_ps::<0x55>(products, products),
        2 => _mm512_shuffle_ps::<0xAA>(products, products),
        _ => _mm512_shuffle_ps::<0xFF>(products, products),
    }
}

/// Tokens `2k` and `2k + 1` of a tile: block `i` of each, in the low and high halves.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")]
fn act_pairs(acts: &[&[BlockQ8_1]; TILE], i: usize) -> (__m512i, __m512i) {
    let (a0, a1, a2, a3) = (&acts[0][i], &acts[1][i], &acts[2][i], &acts[3][i]);
    // SAFETY: each activation's `qs` is 32 readable bytes; unaligned loads are allowed.
    unsafe {
        let load = |a: &BlockQ8_1| _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
        (
            _mm512_inserti64x4(_mm512_castsi256_si512(load(a0)), load(a1), 1),
            _mm512_inserti64x4(_mm512_castsi256_si512(load(a2)), load(a3), 1),
        )
    }
}

/// `[d0 x8, d1 x8]` and `[d2 x8, d3 x8]` from the four tokens' `d` in `dv`'s low lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")]
fn spread(dv: __m128, pair01: __m512i, pair23: __m512i) -> (__m512, __m512) {
    let dv = _mm512_castps128_ps512(dv);
    (
        _mm512_permutexvar_ps(pair01, dv),
        _mm512_permutexvar_ps(pair23, dv),
    )
}

/// Minus `k` times the sum of each lane's four signed activation bytes: the start value
/// that turns `Σ (w + k)·a` into `Σ w·a`. Exact: at most 4 · 128 · 128 in magnitude.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")]
fn offset_start(k: __m512i, a: __m512i) -> __m512i {
    let zero = _mm512_setzero_si512();
    _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, k, a))
}

/// The four tokens' results of two accumulators `[t0 | t1]`, `[t2 | t3]`, each reduced as
/// the 256-bit kernels reduce one, plus that token's offset sum (`0.0` where there is none,
/// added all the same since the 256-bit kernels add theirs).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")]
fn finish(acc01: __m512, acc23: __m512, summs: Option<__m128>) -> [f32; TILE] {
    let mut s = [0f32; TILE];
    if let Some(v) = summs {
        // SAFETY: `s` is 4 writable f32.
        unsafe { _mm_storeu_ps(s.as_mut_ptr(), v) };
    }
    let halves = [
        _mm512_castps512_ps256(acc01),
        _mm512_extractf32x8_ps(acc01, 1),
        _mm512_castps512_ps256(acc23),
        _mm512_extractf32x8_ps(acc23, 1),
    ];
    let mut out = [0f32; TILE];
    for t in 0..TILE {
        out[t] = hsum(halves[t]);
        if summs.is_some() {
            out[t] += s[t];
        }
    }
    out
}

/// A weight block whose values go into `dpbusd` unsigned, as `w + OFFSET`: Q8_0 (signed
/// bytes, offset 128 by flipping the sign bit) and Q4_0 (nibbles `q` for `q - 8`).
trait OffsetBlock: Sync {
    const OFFSET: i8;
    fn scale(&self) -> f32;
    /// The block's 32 values plus [`Self::OFFSET`], in both halves of a register.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and AVX2 (the callers' features).
    unsafe fn unsigned(&self) -> __m512i;
}

impl OffsetBlock for BlockQ8_0 {
    // -128 as a byte is 0x80: adding it is flipping each value's sign bit.
    const OFFSET: i8 = -128;
    fn scale(&self) -> f32 {
        self.d
    }
    #[inline(always)]
    unsafe fn unsigned(&self) -> __m512i {
        // SAFETY: `qs` is 32 readable bytes and `loadu` has no alignment requirement; the
        // caller guarantees the CPU features.
        unsafe {
            let q = _mm256_loadu_si256(self.qs.as_ptr() as *const __m256i);
            _mm512_xor_si512(_mm512_broadcast_i64x4(q), _mm512_set1_epi8(Self::OFFSET))
        }
    }
}

impl OffsetBlock for BlockQ4_0 {
    const OFFSET: i8 = 8;
    fn scale(&self) -> f32 {
        self.d
    }
    #[inline(always)]
    unsafe fn unsigned(&self) -> __m512i {
        // SAFETY: the caller guarantees the CPU features `unpack_nibbles` needs.
        unsafe { _mm512_broadcast_i64x4(unpack_nibbles(&self.qs)) }
    }
}

/// Q8_0: as [`q4_1_rows`] (whole tiles through [`offset_tile`], [`ROWS_Q8_Q5`] rows at a
/// time, then leftover rows one at a time; the tokens after the last tile through the
/// 256-bit kernel).
///
/// # Safety
/// The CPU must support the features [`available`] checks. Slices are bounds-checked.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")]
pub unsafe fn q8_0_rows(w: &[BlockQ8_0], nb: usize, x: &[BlockQ8_1], n: usize, out: &mut [f32]) {
    let done = offset_tiles(w, nb, x, n, out);
    let acts = leftover_tokens(x, nb, done, n);
    if n > done {
        for (r, row) in w.chunks_exact(nb).enumerate() {
            // SAFETY: AVX2, FMA, AVX-512 VNNI and VL are among this function's features.
            unsafe {
                super::x86::vnni::q8_0(row, &acts[..n - done], &mut out[r * n + done..(r + 1) * n])
            };
        }
    }
}

/// Q4_0: as [`q8_0_rows`].
///
/// # Safety
/// The CPU must support the features [`available`] checks. Slices are bounds-checked.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")]
pub unsafe fn q4_0_rows(w: &[BlockQ4_0], nb: usize, x: &[BlockQ8_1], n: usize, out: &mut [f32]) {
    let done = offset_tiles(w, nb, x, n, out);
    let acts = leftover_tokens(x, nb, done, n);
    if n > done {
        for (r, row) in w.chunks_exact(nb).enumerate() {
            // SAFETY: AVX2, FMA, AVX-512 VNNI and VL are among this function's features.
            unsafe {
                super::x86::vnni::q4_0(row, &acts[..n - done], &mut out[r * n + done..(r + 1) * n])
            };
        }
    }
}

/// The whole tiles of [`q8_0_rows`] or [`q4_0_rows`]; returns the tokens done.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")]
fn offset_tiles<B: OffsetBlock>(
    w: &[B],
    nb: usize,
    x: &[BlockQ8_1],
    n: usize,
    out: &mut [f32],
) -> usize {
    let nr = w.len() / nb;
    let tiles = n / TILE;
    let pair01 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    let pair23 = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    for tile in 0..tiles {
        let t0 = tile * TILE;
        let acts: [&[BlockQ8_1]; TILE] =
            std::array::from_fn(|j| &x[(t0 + j) * nb..(t0 + j + 1) * nb]);
        let mut r = 0;
        while r + ROWS_Q8_Q5 <= nr {
            let rows: [&[B]; ROWS_Q8_Q5] =
                std::array::from_fn(|i| &w[(r + i) * nb..(r + i + 1) * nb]);
            let res = offset_tile::<B, ROWS_Q8_Q5>(rows, acts, pair01, pair23);
            for (i, row) in res.iter().enumerate() {
                out[(r + i) * n + t0..(r + i) * n + t0 + TILE].copy_from_slice(row);
            }
            r += ROWS_Q8_Q5;
        }
        while r < nr {
            let res = offset_tile::<B, 1>([&w[r * nb..(r + 1) * nb]], acts, pair01, pair23);
            out[r * n + t0..r * n + t0 + TILE].copy_from_slice(&res[0]);
            r += 1;
        }
    }
    tiles * TILE
}

/// `R` rows against one whole tile of 4 tokens: `[row][token]`. Weights go in as
/// `w + OFFSET`, the lanes starting at `-OFFSET · Σa`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")]
fn offset_tile<B: OffsetBlock, const R: usize>(
    rows: [&[B]; R],
    acts: [&[BlockQ8_1]; TILE],
    pair01: __m512i,
    pair23: __m512i,
) -> [[f32; TILE]; R] {
    let mut acc01 = [_mm512_setzero_ps(); R];
    let mut acc23 = [_mm512_setzero_ps(); R];
    let offset = _mm512_set1_epi8(B::OFFSET);
    for i in 0..rows[0].len() {
        let (a01, a23) = act_pairs(&acts, i);
        let dv = _mm_setr_ps(acts[0][i].d, acts[1][i].d, acts[2][i].d, acts[3][i].d);
        let (da01, da23) = spread(dv, pair01, pair23);
        let (c01, c23) = (offset_start(offset, a01), offset_start(offset, a23));
        for r in 0..R {
            let wb = &rows[r][i];
            // SAFETY: this function has the features `unsigned` needs.
            let wu = unsafe { wb.unsigned() };
            let dw = _mm512_set1_ps(wb.scale());
            let p01 = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c01, wu, a01));
            let p23 = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c23, wu, a23));
            acc01[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, da01), p01, acc01[r]);
            acc23[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, da23), p23, acc23[r]);
        }
    }
    let mut out = [[0f32; TILE]; R];
    for r in 0..R {
        out[r] = finish(acc01[r], acc23[r], None);
    }
    out
}

/// Q5_0 (`with_min` false) or Q5_1 rows (`w` ggml's blocks as bytes, `nb` blocks a row)
/// against the whole tiles of the `n` tokens, `out[r * n + t]`; returns how many tokens
/// it did (a multiple of [`TILE`]); the caller does the rest with the 256-bit kernel.
///
/// # Safety
/// The CPU must support the features [`available`] checks. Slices are bounds-checked.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn five_bit_tiles(
    w: &[u8],
    nb: usize,
    x: &[BlockQ8_1],
    n: usize,
    with_min: bool,
    out: &mut [f32],
) -> usize {
    if with_min {
        five_bit_tiles_for::<true>(w, nb, x, n, out)
    } else {
        five_bit_tiles_for::<false>(w, nb, x, n, out)
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn five_bit_tiles_for<const MIN: bool>(
    w: &[u8],
    nb: usize,
    x: &[BlockQ8_1],
    n: usize,
    out: &mut [f32],
) -> usize {
    let rb = nb * if MIN { 24 } else { 22 };
    let tiles = n / TILE;
    let mut tile = 0;
    while tile < tiles {
        // Two tiles at once where there are two: each weight block is unpacked once for
        // eight tokens instead of four (the per-lane arithmetic is unchanged).
        if tile + 2 <= tiles {
            five_bit_pass::<{ ROWS_Q8_Q5 / 2 }, 2, MIN>(w, rb, nb, x, n, tile, out);
            tile += 2;
        } else {
            five_bit_pass::<ROWS_Q8_Q5, 1, MIN>(w, rb, nb, x, n, tile, out);
            tile += 1;
        }
    }
    tiles * TILE
}

/// Every row (`rb` bytes each) against tiles `tile..tile + P`, `R` rows at a time.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn five_bit_pass<const R: usize, const P: usize, const MIN: bool>(
    w: &[u8],
    rb: usize,
    nb: usize,
    x: &[BlockQ8_1],
    n: usize,
    tile: usize,
    out: &mut [f32],
) {
    let nr = w.len() / rb;
    let t0 = tile * TILE;
    let acts: [[&[BlockQ8_1]; TILE]; P] = std::array::from_fn(|p| {
        std::array::from_fn(|j| &x[(t0 + p * TILE + j) * nb..(t0 + p * TILE + j + 1) * nb])
    });
    let mut r = 0;
    while r < nr {
        let res: [[[f32; TILE]; P]; R];
        let k = if r + R <= nr {
            let rows: [&[u8]; R] = std::array::from_fn(|i| &w[(r + i) * rb..(r + i + 1) * rb]);
            res = five_bit_tile::<R, P, MIN>(rows, acts);
            R
        } else {
            let one = five_bit_tile::<1, P, MIN>([&w[r * rb..(r + 1) * rb]], acts);
            res = [one[0]; R];
            1
        };
        for (i, row) in res.iter().enumerate().take(k) {
            for (p, part) in row.iter().enumerate() {
                let at = (r + i) * n + t0 + p * TILE;
                out[at..at + TILE].copy_from_slice(part);
            }
        }
        r += k;
    }
}

/// `R` Q5_0/Q5_1 rows against `P` whole tiles of 4 tokens: `[row][tile][token]`, lane for
/// lane `quant_simd::five_bit_rows`. Q5_0's values `q - 16` go in as `q`, the lanes starting
/// at `-16 · Σa`; its offset sum stays `0.0`, which the 256-bit kernel adds too.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn five_bit_tile<const R: usize, const P: usize, const MIN: bool>(
    rows: [&[u8]; R],
    acts: [[&[BlockQ8_1]; TILE]; P],
) -> [[[f32; TILE]; P]; R] {
    let (bytes, qh_at) = if MIN { (24, 4) } else { (22, 2) };
    let mut acc01 = [[_mm512_setzero_ps(); P]; R];
    let mut acc23 = [[_mm512_setzero_ps(); P]; R];
    let mut summs = [[_mm_setzero_ps(); P]; R];
    let zero = _mm512_setzero_si512();
    let sixteen = _mm512_set1_epi8(16);
    let mask = _mm512_set1_epi8(0x0f);
    let shifts = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
    let pair01 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    let pair23 = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    for i in 0..rows[0].len() / bytes {
        let mut a01 = [zero; P];
        let mut a23 = [zero; P];
        let mut c01 = [zero; P];
        let mut c23 = [zero; P];
        let mut da01 = [_mm512_setzero_ps(); P];
        let mut da23 = [_mm512_setzero_ps(); P];
        let mut sv = [_mm_setzero_ps(); P];
        for p in 0..P {
            let acts = &acts[p];
            (a01[p], a23[p]) = act_pairs(acts, i);
            let dv = _mm_setr_ps(acts[0][i].d, acts[1][i].d, acts[2][i].d, acts[3][i].d);
            (da01[p], da23[p]) = spread(dv, pair01, pair23);
            if MIN {
                sv[p] = _mm_setr_ps(acts[0][i].s, acts[1][i].s, acts[2][i].s, acts[3][i].s);
            } else {
                c01[p] = offset_start(sixteen, a01[p]);
                c23[p] = offset_start(sixteen, a23[p]);
            }
        }
        for r in 0..R {
            let wb = &rows[r][i * bytes..(i + 1) * bytes];
            let scales = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes([
                wb[0], wb[1], wb[2], wb[3],
            ])));
            let qh = u32::from_le_bytes([wb[qh_at], wb[qh_at + 1], wb[qh_at + 2], wb[qh_at + 3]]);
            let qs = &wb[qh_at + 4..qh_at + 20];
            // SAFETY: `qs` is 16 readable bytes (sliced just above); the load is unaligned.
            let q = unsafe { _mm512_broadcast_i32x4(_mm_loadu_si128(qs.as_ptr().cast())) };
            // Unpacked straight into both halves: in each 256 bits the low 128 hold the low
            // nibbles (elements 0..16), the high 128 the high ones (16..32).
            let nibbles = _mm512_and_si512(_mm512_srlv_epi64(q, shifts), mask);
            // Bit j of `qh` is element j's (byte j's) fifth bit, in each half.
            let bits = u64::from(qh) | u64::from(qh) << 32;
            let wq = _mm512_mask_add_epi8(nibbles, bits, nibbles, sixteen);
            let dw = _mm512_set1_ps(_mm_cvtss_f32(scales));
            let m = _mm_set1_ps(_mm_cvtss_f32(_mm_movehdup_ps(scales)));
            for p in 0..P {
                if MIN {
                    summs[r][p] = _mm_add_ps(summs[r][p], _mm_mul_ps(m, sv[p]));
                }
                let p01 = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c01[p], wq, a01[p]));
                let p23 = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c23[p], wq, a23[p]));
                acc01[r][p] = _mm512_fmadd_ps(_mm512_mul_ps(dw, da01[p]), p01, acc01[r][p]);
                acc23[r][p] = _mm512_fmadd_ps(_mm512_mul_ps(dw, da23[p]), p23, acc23[r][p]);
            }
        }
    }
    let mut out = [[[0f32; TILE]; P]; R];
    for r in 0..R {
        for p in 0..P {
            out[r][p] = finish(acc01[r][p], acc23[r][p], Some(summs[r][p]));
        }
    }
    out
}

/// Tokens `whole..n` of `x` (fewer than a tile), for the 256-bit kernels.
fn leftover_tokens(x: &[BlockQ8_1], nb: usize, whole: usize, n: usize) -> [&[BlockQ8_1]; TILE] {
    let mut acts: [&[BlockQ8_1]; TILE] = [&[]; TILE];
    for (a, chunk) in acts.iter_mut().zip(x[whole * nb..n * nb].chunks_exact(nb)) {
        *a = chunk;
    }
    acts
}
