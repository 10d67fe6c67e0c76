//! Register-tiled products of the 32-element block formats in llama.cpp's order (Q4_1, Q5_1)
//! for CPUs with AVX-512 VNNI: a micro-tile of [`ROWS`] weight rows × a pass of two tiles of
//! 4 tokens (one tile at the end when the count is odd), two tokens per 512-bit register
//! (token `2k` in the low half, `2k + 1` in the high half). Each weight block is unpacked
//! once for the pass's tokens, each activation pair loaded once for the micro-tile's rows.
//! One generic tile serves every format; [`PairBlock`] is all that differs.
//!
//! Every lane does exactly what the 256-bit kernels do for its token (the same `dpbusd`
//! sums, the same `d_w * d_a` product, the same fused multiply-add into the same lane, the
//! same `m_w * s_a` running sum and final reduction), so results are bit-identical to them,
//! and so to llama.cpp: the wider registers only run two tokens' lanes side by side.
//!
//! Where the time goes (Zen 5, measured with instruction loops): `dpbusd`, the
//! multiply-add and a plain multiply share two pipes, the int-to-float conversion and
//! shuffles run on two others. So the per-pair scale product `d_w * d_a` is not a multiply
//! per row and token pair: one multiply per row and block makes every pair's product at
//! once (the activation scales laid out by [`PassScales`]), and an in-lane shuffle picks
//! each pair's (1.05 cycles a pair against 1.5).
//!
//! Both formats' values are unsigned (a minimum carries the offset), so they go into
//! `dpbusd` (unsigned × signed bytes) as they are.
//!
//! A few tokens per weight (a decode batch, a speculative verification of 2 to 12 rows)
//! leave the weight loads exposed, as in the one-token kernels: the micro-tile prefetches
//! each row's blocks 2 KiB ahead (one row and 3 drafts 19.9 -> 15.4 ms a step on the default
//! model, 8 rows decoding 31.7 -> 28.8 ms; prefill unchanged), and 5 to 7 tokens are padded
//! to a pair of tiles (the last token repeated, its lanes dropped) instead of a 256-bit pass
//! over the weights per token after the last tile (7 rows 27.7 -> 23.0 ms), here and in the
//! k-quant tiles (`padded_to_tiles`; on the default model's Q4_K_M file 7 rows 29.4 -> 24.4
//! ms).

use std::arch::x86_64::*;

use super::tile_out::{Out, ROWS};
use crate::blocks::{BlockQ4_1, BlockQ8_1, TILE};

/// Token pairs of a pass of two tiles.
const PAIRS: usize = TILE;

/// A weight block format as the pair tiles need it.
pub(crate) trait PairBlock: Sync {
    /// Whether the format has a minimum (`m_w * s_a`, summed apart: ggml's `summs`).
    const MIN: bool;
    /// Whether the 256-bit kernel adds the minimum sum to the result: adding `0.0` can turn
    /// `-0.0` into `0.0`, so it is done here too.
    const ADDS_MIN_SUM: bool;
    /// `(d_w, m_w)`; `m_w` unused without [`Self::MIN`].
    ///
    /// # Safety
    /// The CPU must support the features [`super::cpu::wide_available`] checks.
    unsafe fn scales(&self) -> (f32, f32);
    /// `d_w` in every lane.
    ///
    /// # Safety
    /// The CPU must support the features [`super::cpu::wide_available`] checks.
    #[inline(always)]
    unsafe fn scale_lanes(&self) -> __m512 {
        // SAFETY: the caller guarantees the CPU features.
        unsafe { _mm512_set1_ps(self.scales().0) }
    }
    /// The block's 32 values as unsigned bytes, in element order, in
    /// both halves of a register.
    ///
    /// # Safety
    /// The CPU must support the features [`super::cpu::wide_available`] checks.
    unsafe fn unsigned(&self) -> __m512i;
}

/// 16 packed nibbles → 32 bytes in element order (low nibbles are elements 0..16), in both
/// halves: one variable shift for all four quarters.
#[inline(always)]
unsafe fn nibbles(qs: &[u8; 16]) -> __m512i {
    // SAFETY: `qs` is 16 readable bytes (unaligned load); the caller guarantees AVX-512 F.
    unsafe {
        let q = _mm512_broadcast_i32x4(_mm_loadu_si128(qs.as_ptr().cast()));
        let shifts = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
        _mm512_and_si512(_mm512_srlv_epi64(q, shifts), _mm512_set1_epi8(0x0f))
    }
}

/// Q4_1 unpacks its nibbles in the pass: unpacked once per product instead, as Q4_0 is, it
/// measured 1.5% slower on the default model's prefill (its minimum term leaves the unpack a
/// smaller share, and the unpacked rows are twice the bytes).
impl PairBlock for BlockQ4_1 {
    const MIN: bool = true;
    const ADDS_MIN_SUM: bool = true;
    #[inline(always)]
    unsafe fn scales(&self) -> (f32, f32) {
        (self.d, self.m)
    }
    #[inline(always)]
    unsafe fn unsigned(&self) -> __m512i {
        // SAFETY: the caller guarantees the CPU features.
        unsafe { nibbles(&self.qs) }
    }
}

/// Two little-endian f16 values as f32, in one conversion.
#[inline(always)]
unsafe fn f16_pair(bytes: [u8; 4]) -> (f32, f32) {
    // SAFETY: the caller guarantees F16C.
    unsafe {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes(bytes)));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }
}

/// A little-endian f16 in all 16 lanes as f32: broadcast, then one conversion (one
/// instruction fewer than converting the scalar and broadcasting it).
#[inline(always)]
unsafe fn f16_lanes(bytes: [u8; 2]) -> __m512 {
    // SAFETY: the caller guarantees AVX-512 F (which includes the 512-bit conversion).
    unsafe { _mm512_cvtph_ps(_mm256_set1_epi16(i16::from_le_bytes(bytes))) }
}

/// The fifth bits `qh` (bit j: element j) added to the nibbles as 16.
#[inline(always)]
unsafe fn five_bits(qh: [u8; 4], qs: &[u8; 16]) -> __m512i {
    let qh = u32::from_le_bytes(qh);
    let bits = u64::from(qh) | u64::from(qh) << 32;
    // SAFETY: the caller guarantees AVX-512 F and BW.
    unsafe {
        let q = _mm512_broadcast_i32x4(_mm_loadu_si128(qs.as_ptr().cast()));
        let shifted = _mm512_srlv_epi64(q, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0));
        let fifth = _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(16));
        // (shifted & 0x0f) | fifth in one instruction (truth table 0xEA: (a & b) | c).
        _mm512_ternarylogic_epi64::<0xEA>(shifted, _mm512_set1_epi8(0x0f), fifth)
    }
}

/// ggml's Q5_1 block: f16 `d` and `m`, 4 bytes of fifth bits, 16 of nibbles; the values
/// are unsigned, with a minimum.
impl PairBlock for [u8; 24] {
    const MIN: bool = true;
    const ADDS_MIN_SUM: bool = true;
    #[inline(always)]
    unsafe fn scales(&self) -> (f32, f32) {
        // SAFETY: the caller guarantees F16C.
        unsafe { f16_pair([self[0], self[1], self[2], self[3]]) }
    }
    #[inline(always)]
    unsafe fn scale_lanes(&self) -> __m512 {
        // SAFETY: the caller guarantees the CPU features.
        unsafe { f16_lanes([self[0], self[1]]) }
    }
    #[inline(always)]
    unsafe fn unsigned(&self) -> __m512i {
        let (qh, qs) = (self[4..8].try_into(), self[8..].try_into());
        // SAFETY: the caller guarantees the CPU features.
        unsafe { five_bits(qh.unwrap_or_default(), &qs.unwrap_or_default()) }
    }
}

/// Q4_1: `out[r * n + t] = dot(w[r], x[t])` for the rows of `w` (`nb` blocks each) and all
/// `n` tokens: whole tiles through [`pair_tiles`], the tokens after the last tile through the
/// 256-bit kernel.
///
/// # Safety
/// The CPU must support the features [`super::cpu::wide_available`] checks. Slices are bounds-checked.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn q4_1_rows(w: &[BlockQ4_1], nb: usize, x: &[BlockQ8_1], n: usize, out: &mut [f32]) {
    // SAFETY (each kernel): AVX2, FMA, AVX-512 VNNI and VL are among this function's features.
    block_rows(w, w, nb, x, n, out, |row, acts, out| unsafe {
        super::x86::vnni::q4_1(row, acts, None, out)
    });
}

/// Row-major rows of a block format: whole tiles through [`pair_tiles`] on `tiled` (the
/// rows as the tile reads them), then each row of `w` (the same rows as stored) against the
/// tokens after the last tile through `leftover` (the format's 256-bit kernel, one row
/// against up to three tokens).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn block_rows<B: PairBlock, W>(
    tiled: &[B],
    w: &[W],
    nb: usize,
    x: &[BlockQ8_1],
    n: usize,
    out: &mut [f32],
    leftover: impl Fn(&[W], &[&[BlockQ8_1]], &mut [f32]),
) {
    if padded_to_tiles(x, nb, n, out, |xp, np, wide| {
        pair_tiles(tiled, nb, xp, np, &mut Out::RowMajor { out: wide, n: np });
    }) {
        return;
    }
    let done = pair_tiles(tiled, nb, x, n, &mut Out::RowMajor { out, n });
    let acts = leftover_tokens(x, nb, done, n);
    if n > done {
        for (r, row) in w.chunks_exact(nb).enumerate() {
            leftover(row, &acts[..n - done], &mut out[r * n + done..(r + 1) * n]);
        }
    }
}

/// For `n` tokens past a whole tile and not a multiple of one (a decode batch, a speculative
/// verification): `tiles(x, n_padded, scratch)` on the tokens padded to whole tiles (the
/// last one repeated), each row's first `n` results copied into row-major `out`
/// (`out[r * n + t]`, `per_token` activation blocks a token); false, nothing done, for other
/// `n`. The tail would otherwise cost the 256-bit kernel a pass over the weights per token,
/// where padding costs lanes of the same pass; each lane's arithmetic is its own token's, so
/// the bits are the same. (One token to three stay with the 256-bit kernel: measured
/// cheaper than a padded tile.)
pub(crate) fn padded_to_tiles<X: Clone>(
    x: &[X],
    per_token: usize,
    n: usize,
    out: &mut [f32],
    tiles: impl FnOnce(&[X], usize, &mut [f32]),
) -> bool {
    if n <= TILE || n.is_multiple_of(TILE) {
        return false;
    }
    let padded = n.next_multiple_of(TILE);
    let mut xp = Vec::with_capacity(padded * per_token);
    xp.extend_from_slice(&x[..n * per_token]);
    for _ in n..padded {
        xp.extend_from_slice(&x[(n - 1) * per_token..n * per_token]);
    }
    let rows = out.len() / n;
    let mut wide = vec![0f32; rows * padded];
    tiles(&xp, padded, &mut wide);
    for (o, row) in out.chunks_exact_mut(n).zip(wide.chunks_exact(padded)) {
        o.copy_from_slice(&row[..n]);
    }
    true
}

/// The tokens [`row_major_tiles`] and the k-quant tiles compute for `n`: every one where
/// [`padded_to_tiles`] pads, else the whole tiles.
#[cfg(test)]
pub(crate) fn tiled_tokens(n: usize) -> usize {
    if n > TILE {
        n
    } else {
        n / TILE * TILE
    }
}

/// The rows of `w` (`nb` blocks each) against the `n` tokens, `out[r * n + t]`; returns how
/// many tokens it did ([`tiled_tokens`]: all of them past a tile, padded, else the whole
/// tiles); the caller does the rest with the 256-bit kernel. (Q5_1, whose blocks the tiles
/// read as stored.)
///
/// # Safety
/// The CPU must support the features [`super::cpu::wide_available`] checks. Slices are
/// bounds-checked.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn row_major_tiles<B: PairBlock>(
    w: &[B],
    nb: usize,
    x: &[BlockQ8_1],
    n: usize,
    out: &mut [f32],
) -> usize {
    if padded_to_tiles(x, nb, n, out, |xp, np, wide| {
        pair_tiles(w, nb, xp, np, &mut Out::RowMajor { out: wide, n: np });
    }) {
        return n;
    }
    pair_tiles(w, nb, x, n, &mut Out::RowMajor { out, n })
}

/// `out[t * ld + r] = dot(w[r], x[t])`: the result token-major, as the layer's output is, so
/// that a prefill needs no transposition of each row block's result (4-5% of a prefill).
/// Only whole tiles: returns false, doing nothing, when `n` is not a multiple of [`TILE`].
///
/// # Safety
/// The CPU must support the features [`super::cpu::wide_available`] checks. Slices are
/// bounds-checked.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn token_major<B: PairBlock>(
    w: &[B],
    nb: usize,
    x: &[BlockQ8_1],
    n: usize,
    out: &mut [f32],
    ld: usize,
) -> bool {
    if !n.is_multiple_of(TILE) {
        return false;
    }
    pair_tiles(w, nb, x, n, &mut Out::TokenMajor { out, ld });
    true
}

/// Every row of `w` (`nb` blocks each) against the whole tiles of the `n` tokens, into
/// `out`; returns the tokens done (a multiple of [`TILE`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn pair_tiles<B: PairBlock>(
    w: &[B],
    nb: usize,
    x: &[BlockQ8_1],
    n: usize,
    out: &mut Out<'_>,
) -> usize {
    let tiles = n / TILE;
    // SAFETY: all-zero bytes are valid integer and float vectors.
    let empty: PassBlock = unsafe { std::mem::zeroed() };
    let mut blocks = vec![empty; nb];
    let mut tile = 0;
    while tile < tiles {
        // Two tiles at once where there are two: each weight block is unpacked once for
        // eight tokens instead of four (the per-lane arithmetic is unchanged).
        if tile + 2 <= tiles {
            pass::<B, 2>(w, nb, x, tile, &mut blocks, out);
            tile += 2;
        } else {
            pass::<B, 1>(w, nb, x, tile, &mut blocks, out);
            tile += 1;
        }
    }
    tiles * TILE
}

/// One block of a pass's activations, laid out once for all the micro-tiles of the pass:
/// the token pairs' bytes as `dpbusd` takes them, the scales `d` as `[d0 d2 d4 d6, d0 d2 d4 d6, d1 d3 d5 d7,
/// d1 d3 d5 d7]` (so that `d_w` times them holds every pair's product, for
/// [`pair_products`]) and the sums `s` in token order.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct PassBlock {
    pairs: [__m512i; PAIRS],
    d: [f32; 16],
    s: [f32; 8],
}

/// Lays out block `i` of the `4P` tokens of a pass.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn pass_block<B: PairBlock, const P: usize>(
    acts: &[[&[BlockQ8_1]; TILE]; P],
    i: usize,
    out: &mut PassBlock,
) {
    // Token t's lane in `d` (and again 4 lanes on).
    const LANE: [usize; 8] = [0, 8, 1, 9, 2, 10, 3, 11];
    for (p, acts) in acts.iter().enumerate() {
        let (a, b) = act_pairs(acts, i);
        out.pairs[2 * p] = a;
        out.pairs[2 * p + 1] = b;
        for (j, act) in acts.iter().enumerate() {
            let t = p * TILE + j;
            out.d[LANE[t]] = act[i].d;
            out.d[LANE[t] + 4] = act[i].d;
            out.s[t] = act[i].s;
        }
    }
}

/// Every row against tiles `tile..tile + P` (`4P` tokens), [`ROWS`] rows at a time.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn pass<B: PairBlock, const P: usize>(
    w: &[B],
    nb: usize,
    x: &[BlockQ8_1],
    tile: usize,
    blocks: &mut [PassBlock],
    out: &mut Out<'_>,
) {
    let nr = w.len() / nb;
    let t0 = tile * TILE;
    let acts: [[&[BlockQ8_1]; TILE]; P] = std::array::from_fn(|p| {
        std::array::from_fn(|j| &x[(t0 + p * TILE + j) * nb..(t0 + p * TILE + j + 1) * nb])
    });
    for (i, block) in blocks.iter_mut().enumerate() {
        pass_block::<B, P>(&acts, i, block);
    }
    let blocks = &blocks[..];
    let mut r = 0;
    while r + ROWS <= nr {
        // A plain loop: `array::from_fn` stayed a call per micro-tile (1.4% of a prefill).
        let mut rows: [&[B]; ROWS] = [&[]; ROWS];
        for (i, row) in rows.iter_mut().enumerate() {
            *row = &w[(r + i) * nb..(r + i + 1) * nb];
        }
        out.put_rows(r, t0, P * TILE, micro_tile::<B, ROWS, P>(rows, blocks));
        r += ROWS;
    }
    while r < nr {
        let [one] = micro_tile::<B, 1, P>([&w[r * nb..(r + 1) * nb]], blocks);
        out.put_row(r, t0, P * TILE, one);
        r += 1;
    }
}

/// `R` rows against a pass of `P` whole tiles of 4 tokens: per row, its `4P` results in
/// token order (lanes past `4P` undefined).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn micro_tile<B: PairBlock, const R: usize, const P: usize>(
    rows: [&[B]; R],
    blocks: &[PassBlock],
) -> [__m256; R] {
    let mut acc = [[_mm512_setzero_ps(); PAIRS]; R];
    let zero = _mm512_setzero_si512();
    assert!(rows.iter().all(|r| r.len() == blocks.len()));
    for (i, pb) in blocks.iter().enumerate() {
        // SAFETY: `d` is 16 readable f32; unaligned loads are allowed.
        let d = unsafe { _mm512_loadu_ps(pb.d.as_ptr()) };
        for (row, acc) in rows.iter().zip(acc.iter_mut()) {
            let block = &row[i];
            // A few tokens per weight (decode batches, speculative verification) leave the
            // loads exposed, as in the one-token kernels.
            super::x86::prefetch_ahead(block);
            // SAFETY: this function has the features `unsigned` and `scale_lanes` need.
            let (wu, dw) = unsafe { (block.unsigned(), block.scale_lanes()) };
            let products = _mm512_mul_ps(dw, d);
            // Indexed on purpose: with iterators the compiler kept the accumulators in
            // memory and the shuffle a run-time branch (measured 2.6 times slower).
            #[allow(clippy::needless_range_loop)]
            for k in 0..2 * P {
                let sums = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, wu, pb.pairs[k]));
                acc[k] = _mm512_fmadd_ps(pair_products(products, k), sums, acc[k]);
            }
        }
    }
    // The minimums' running sums apart from the products: the same additions in the same
    // order, without holding `R` more registers through the loop above.
    let mut min_sums = [_mm256_setzero_ps(); R];
    if B::MIN {
        for (i, pb) in blocks.iter().enumerate() {
            // SAFETY: `s` is 8 readable f32; unaligned loads are allowed.
            let s = unsafe { _mm256_loadu_ps(pb.s.as_ptr()) };
            for (row, sum) in rows.iter().zip(min_sums.iter_mut()) {
                // SAFETY: this function has the features `scales` needs.
                let m = _mm256_set1_ps(unsafe { row[i].scales().1 });
                *sum = _mm256_add_ps(*sum, _mm256_mul_ps(m, s));
            }
        }
    }
    std::array::from_fn(|r| reduce_pairs::<P>(&acc[r], B::ADDS_MIN_SUM.then_some(min_sums[r])))
}

/// Token pair `k`'s products `[p_2k x8, p_2k+1 x8]` out of `d_w` times a [`PassScales`]
/// `d`: one in-lane shuffle.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn pair_products(products: __m512, k: usize) -> __m512 {
    match k {
        0 => _mm512_shuffle_ps::<0x00>(products, products),
        1 => _mm512_shuffle_ps::<0x55>(products, products),
        2 => _mm512_shuffle_ps::<0xAA>(products, products),
        _ => _mm512_shuffle_ps::<0xFF>(products, products),
    }
}

/// The `4P` tokens' results of `2P` pair accumulators `[t_2k | t_2k+1]`, in token order
/// (lanes past `4P` undefined): each token's eight lanes reduced exactly as the 256-bit
/// kernels' `hsum` reduces them (high half plus low half, then lanes 0+2 and 1+3, then
/// those two), plus that token's minimum sum where there is one. The same additions on the
/// same operands, done for eight tokens at once by shuffling them side by side.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn reduce_pairs<const P: usize>(acc: &[__m512; PAIRS], mins: Option<__m256>) -> __m256 {
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
    match mins {
        Some(m) => _mm256_add_ps(in_order, m),
        None => in_order,
    }
}

/// Tokens `2k` and `2k + 1` of a tile: block `i` of each, in the low and high halves.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
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

/// Tokens `whole..n` of `x` (fewer than a tile), for the 256-bit kernels.
fn leftover_tokens(x: &[BlockQ8_1], nb: usize, whole: usize, n: usize) -> [&[BlockQ8_1]; TILE] {
    let mut acts: [&[BlockQ8_1]; TILE] = [&[]; TILE];
    for (a, chunk) in acts.iter_mut().zip(x[whole * nb..n * nb].chunks_exact(nb)) {
        *a = chunk;
    }
    acts
}
