//! Q4_K and Q6_K products with the weight rows as lanes, for CPUs with AVX-512 VNNI: the
//! decode-sized products (a few tokens) on the row-interleaved layout of
//! `quant/interleaved.rs`, sixteen rows per tile. A tile's word `w` of sixteen rows is one
//! 64-byte load, so one `vpdpbusd` against a broadcast activation quad does 64
//! multiply-adds, and each super-block's scales, mins and float factors are unpacked once
//! for sixteen rows in vector registers, where the one-row kernel (`avx2_kquants`) spent
//! most of its time on them: on a 2-core Zen 4 that kernel streamed Q4_K weights at about
//! 22 GB/s against about 40 for the same bytes of a plain copy.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes: the weights enter as unsigned (Q4_K's
//! 0..15, Q6_K's 0..63) and the activations as they are. Q6_K's `−32` is taken off each
//! group's integer sum as `32·Σ a` (the activations' `bsums`). Every sum is an exact `i32`,
//! and the float part is the format's chain (`Q4K::dot_with`, `Q6K::dot_with`) lane for
//! lane, so the results are the definitions' bits (`quant/tests.rs`).

use std::arch::x86_64::*;
use std::ops::Range;

use super::tile_out::Out;
use super::x86_512_lanes::Format;
use crate::blocks::BlockQ8K;

/// Rows per tile: the `i32` lanes of a 512-bit register.
pub(crate) const TILE_ROWS: usize = 16;
/// Bytes of a Q4_K tile: `d`, `dmin` (16 f16 each), then the 35 words of 16 rows (the
/// scale words 0..3, the quants 3..35).
pub(crate) const Q4_K_TILE: usize = 16 * 144;
/// Bytes of a Q6_K tile: `d` (16 f16), then the 52 words of 16 rows: for each half of the
/// block and half of each 32 elements, each quad's two `ql` words and its `qh` word (the
/// order of reading), then the four scale words.
pub(crate) const Q6_K_TILE: usize = 16 * 210;

/// Tokens whose accumulators share one pass over a tile's weights.
const PASS_TOKENS: usize = 4;

/// Tokens whose passes take each tile in turn, so that a tile read once from memory serves
/// them all (`quant::interleaved::ROWS_LANES_MAX`, the most this kernel is given): with a
/// pass over the whole group per four tokens, an eight-token decode step streamed the
/// weights in its first pass and computed the second from cache afterwards.
const TILE_TOKENS: usize = 8 * PASS_TOKENS;

/// Tiles ahead whose lines are requested while a tile is computed, where a pass computes
/// several tokens: a decode step streams every weight once, and with the compute of eight
/// tokens per tile the hardware prefetcher alone left the cores waiting (a batch of eight
/// 30% slower without the requests). One token's pass streams faster without them on AMD's
/// cores (`cpu::one_token_prefetch`): on a 2-core Zen 4, one-stream decode of the 1B- and
/// 3B-shaped files ran 8-18% faster (two to four tokens the same either way).
const PREFETCH_TILES: usize = 2;

/// Word `w` of a tile's sixteen rows, `f16s` half-precision fields in front; where `ahead`,
/// the same line [`PREFETCH_TILES`] tiles on is requested.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) fn word(tile: &[u8], f16s: usize, w: usize, ahead: bool) -> __m512i {
    let at = 32 * f16s + 64 * w;
    let src = &tile[at..at + 64];
    if ahead {
        let line = src
            .as_ptr()
            .cast::<i8>()
            .wrapping_add(PREFETCH_TILES * tile.len());
        // A hint: it never faults, whatever the address (`wrapping_add` forms it without
        // claiming it is in bounds).
        _mm_prefetch::<_MM_HINT_T0>(line);
    }
    // SAFETY: `src` is 64 readable bytes (sliced above); the load is unaligned.
    unsafe { _mm512_loadu_si512(src.as_ptr().cast()) }
}

/// Half-precision field `k` of a tile's sixteen rows, widened.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) fn halves(tile: &[u8], k: usize) -> __m512 {
    let src = &tile[32 * k..32 * k + 32];
    // SAFETY: `src` is 32 readable bytes (sliced above); the load is unaligned.
    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(src.as_ptr().cast()) })
}

/// Activation quad `at..at + 4` of a super-block, in every lane. With several tokens, read
/// as a vector, so that the broadcast folds into the multiply-add: built from four bytes as
/// an `i32`, the quads were loaded into general registers ahead of use and spilled, and
/// four- and eight-token passes ran 30% slower. With one token that form is the faster.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn quad<const T: usize>(a: &BlockQ8K, at: usize) -> __m512i {
    let q = &a.qs[at..at + 4];
    if T == 1 {
        return _mm512_set1_epi32(i32::from_le_bytes([
            q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8,
        ]));
    }
    // SAFETY: `q` is 4 readable bytes (sliced above); the load is unaligned.
    _mm512_broadcastd_epi32(unsafe { _mm_loadu_si32(q.as_ptr().cast()) })
}

/// In every `i32` lane, byte `b` of the lane alone (`b < 4`), or bytes `b` and `b + 1` as
/// the low bytes of its two 16-bit halves (`pair`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn bytes_of_lanes(v: __m512i, b: usize, pair: bool) -> __m512i {
    let z = -128i8 as u8;
    let lane = if pair {
        [b as u8, z, b as u8 + 1, z]
    } else {
        [b as u8, z, z, z]
    };
    let pick: [u8; 16] = std::array::from_fn(|i| {
        let v = lane[i % 4];
        if v == z {
            z
        } else {
            v + 4 * (i / 4) as u8
        }
    });
    // SAFETY: `pick` is 16 readable bytes; the load is unaligned.
    let pick = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(pick.as_ptr().cast()) });
    _mm512_shuffle_epi8(v, pick)
}

/// The tiles of `format` (groups of sixteen rows, `[group * nb + i]`, `nb` super-blocks a
/// row) against the `n` tokens of `x` (`nb` blocks each), into `out` (rows numbered from the
/// first group's first).
///
/// # Safety
/// The CPU must support the features `super::cpu::wide_available` checks, and F16C.
/// Slices are bounds-checked.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn tile_rows(
    format: Format,
    tiles: &[u8],
    nb: usize,
    x: &[BlockQ8K],
    n: usize,
    out: &mut Out<'_>,
) {
    let group = nb * format.tile_bytes();
    assert!(x.len() >= n * nb, "tile_rows: activations too short");
    for (g, tiles) in tiles.chunks_exact(group).enumerate() {
        for t_block in (0..n).step_by(TILE_TOKENS) {
            // Each tile serves every pass of the block before the next one is read: the
            // first pass streams it from memory, the others find it in L1.
            let passes = (n - t_block).min(TILE_TOKENS).div_ceil(PASS_TOKENS);
            let pass = |p: usize| Rows {
                tiles,
                nb,
                x,
                t0: t_block + p * PASS_TOKENS,
                r0: g * TILE_ROWS,
            };
            if passes == 1 {
                // One pass keeps its sums in registers over the whole row.
                let (rows, mut acc) = (pass(0), [_mm512_setzero_ps(); PASS_TOKENS]);
                rows.run(format, n - rows.t0, 0..nb, &mut acc);
                rows.put(&acc[..n - rows.t0], out);
                continue;
            }
            // Several take each super-block in turn.
            let mut acc = [[_mm512_setzero_ps(); PASS_TOKENS]; TILE_TOKENS / PASS_TOKENS];
            for i in 0..nb {
                for (p, acc) in acc.iter_mut().enumerate().take(passes) {
                    let rows = pass(p);
                    rows.run(format, n - rows.t0, i..i + 1, acc);
                }
            }
            for (p, acc) in acc.iter().enumerate().take(passes) {
                let rows = pass(p);
                rows.put(&acc[..PASS_TOKENS.min(n - rows.t0)], out);
            }
        }
    }
}

/// One group's tiles against tokens `t0..t0 + T`.
struct Rows<'a> {
    tiles: &'a [u8],
    nb: usize,
    x: &'a [BlockQ8K],
    t0: usize,
    r0: usize,
}

impl Rows<'_> {
    /// Super-blocks `blocks`' share of this pass's tokens (`tokens` from `t0`, the pass
    /// taking at most [`PASS_TOKENS`]), added to `acc`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn run(&self, format: Format, tokens: usize, blocks: Range<usize>, acc: &mut [__m512]) {
        match (format, tokens) {
            (Format::Q4K, 1) => self.q4_k::<1>(blocks, acc),
            (Format::Q4K, 2) => self.q4_k::<2>(blocks, acc),
            (Format::Q4K, 3) => self.q4_k::<3>(blocks, acc),
            (Format::Q4K, _) => self.q4_k::<PASS_TOKENS>(blocks, acc),
            (Format::Q6K, 1) => self.q6_k::<1>(blocks, acc),
            (Format::Q6K, 2) => self.q6_k::<2>(blocks, acc),
            (Format::Q6K, 3) => self.q6_k::<3>(blocks, acc),
            (Format::Q6K, _) => self.q6_k::<PASS_TOKENS>(blocks, acc),
        }
    }

    /// Token `t`'s super-block `i`.
    #[inline(always)]
    fn act(&self, t: usize, i: usize) -> &BlockQ8K {
        &self.x[(self.t0 + t) * self.nb + i]
    }

    // The register arrays are indexed by token.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    /// Super-blocks `blocks`' share of tokens `t0..t0 + T`, added to `sums`.
    fn q4_k<const T: usize>(&self, blocks: Range<usize>, sums: &mut [__m512]) {
        let mut acc: [__m512; T] = std::array::from_fn(|t| sums[t]);
        let zero = _mm512_setzero_si512();
        let nibble = _mm512_set1_epi8(0x0f);
        let ahead = T > 1 || super::cpu::one_token_prefetch();
        for i in blocks {
            let tile = &self.tiles[i * Q4_K_TILE..(i + 1) * Q4_K_TILE];
            // `k4_scales_mins` lane by lane: words a, b, c of each row's 12 scale bytes.
            let (a, b, c) = (
                word(tile, 2, 0, ahead),
                word(tile, 2, 1, ahead),
                word(tile, 2, 2, ahead),
            );
            let [sc_lo, sc_hi, m_lo, m_hi] = q4_k_scale_words(a, b, c);
            let sc: [__m512i; 8] = std::array::from_fn(|j| {
                bytes_of_lanes(if j < 4 { sc_lo } else { sc_hi }, j % 4, false)
            });
            let m_pairs: [__m512i; 4] = std::array::from_fn(|p| {
                bytes_of_lanes(if p < 2 { m_lo } else { m_hi }, 2 * (p % 2), true)
            });
            let mut s = [zero; T];
            for c in 0..4 {
                let tile = std::hint::black_box(tile);
                let mut lo = [zero; T];
                let mut hi = [zero; T];
                for q in 0..8 {
                    let w = word(tile, 2, 3 + 8 * c + q, ahead);
                    let wl = _mm512_and_si512(w, nibble);
                    let wh = _mm512_and_si512(_mm512_srli_epi16::<4>(w), nibble);
                    for t in 0..T {
                        let a = self.act(t, i);
                        lo[t] = _mm512_dpbusd_epi32(lo[t], wl, quad::<T>(a, 64 * c + 4 * q));
                        hi[t] = _mm512_dpbusd_epi32(hi[t], wh, quad::<T>(a, 64 * c + 32 + 4 * q));
                    }
                }
                for t in 0..T {
                    let scaled = _mm512_add_epi32(
                        _mm512_mullo_epi32(lo[t], sc[2 * c]),
                        _mm512_mullo_epi32(hi[t], sc[2 * c + 1]),
                    );
                    s[t] = _mm512_add_epi32(s[t], scaled);
                }
            }
            let (d_w, dmin_w) = (halves(tile, 0), halves(tile, 1));
            for t in 0..T {
                let a = self.act(t, i);
                // Sub-block sums `2p` and `2p + 1` as the halves of an `i32`.
                let sum = |j: usize| a.bsums[2 * j] + a.bsums[2 * j + 1];
                let mut mins = zero;
                for p in 0..4 {
                    let pair =
                        i32::from(sum(2 * p) as u16) | (i32::from(sum(2 * p + 1) as u16) << 16);
                    mins = _mm512_dpwssd_epi32(mins, m_pairs[p], _mm512_set1_epi32(pair));
                }
                let d = _mm512_mul_ps(_mm512_set1_ps(a.d), d_w);
                acc[t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s[t]), acc[t]);
                let dmin = _mm512_mul_ps(_mm512_set1_ps(-a.d), dmin_w);
                acc[t] = _mm512_fmadd_ps(dmin, _mm512_cvtepi32_ps(mins), acc[t]);
            }
        }
        sums[..T].copy_from_slice(&acc);
    }

    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    /// Super-blocks `blocks`' share of tokens `t0..t0 + T`, added to `sums`.
    fn q6_k<const T: usize>(&self, blocks: Range<usize>, sums: &mut [__m512]) {
        let mut acc: [__m512; T] = std::array::from_fn(|t| sums[t]);
        let zero = _mm512_setzero_si512();
        let ahead = T > 1 || super::cpu::one_token_prefetch();
        for i in blocks {
            let tile = &self.tiles[i * Q6_K_TILE..(i + 1) * Q6_K_TILE];
            let mut s = [zero; T];
            for half in 0..2 {
                // Groups 8·half + 2k (quads 0..4 of each 32) and 8·half + 2k + 1 (4..8).
                for upper in 0..2 {
                    let tile = std::hint::black_box(tile);
                    let mut g = [[zero; T]; 4];
                    for q in 4 * upper..4 * upper + 4 {
                        // The tile holds these three words in the order they are read.
                        let slot = 12 * (2 * half + upper) + 3 * (q - 4 * upper);
                        let ql0 = word(tile, 1, slot, ahead);
                        let ql1 = word(tile, 1, slot + 1, ahead);
                        let h = word(tile, 1, slot + 2, ahead);
                        let v = q6_k_values(ql0, ql1, h);
                        for t in 0..T {
                            let a = self.act(t, i);
                            for k in 0..4 {
                                let at = 128 * half + 32 * k + 4 * q;
                                g[k][t] = _mm512_dpbusd_epi32(g[k][t], v[k], quad::<T>(a, at));
                            }
                        }
                    }
                    for k in 0..4 {
                        let group = 8 * half + 2 * k + upper;
                        let scales = word(tile, 1, 48 + group / 4, ahead);
                        // Each lane's signed scale byte moved to the top, shifted down.
                        let up = _mm512_set1_epi32(24 - 8 * (group % 4) as i32);
                        let sc = _mm512_srai_epi32::<24>(_mm512_sllv_epi32(scales, up));
                        for t in 0..T {
                            // Σ (q − 32)·a = Σ q·a − 32·Σ a.
                            let offset = 32 * i32::from(self.act(t, i).bsums[group]);
                            let sum = _mm512_sub_epi32(g[k][t], _mm512_set1_epi32(offset));
                            s[t] = _mm512_add_epi32(s[t], _mm512_mullo_epi32(sum, sc));
                        }
                    }
                }
            }
            let d_w = halves(tile, 0);
            for t in 0..T {
                let d = _mm512_mul_ps(_mm512_set1_ps(self.act(t, i).d), d_w);
                acc[t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s[t]), acc[t]);
            }
        }
        sums[..T].copy_from_slice(&acc);
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn put(&self, acc: &[__m512], out: &mut Out<'_>) {
        for (t, &v) in acc.iter().enumerate() {
            let mut vals = [0f32; TILE_ROWS];
            // SAFETY: `vals` is 16 writable f32; the store is unaligned.
            unsafe { _mm512_storeu_ps(vals.as_mut_ptr(), v) };
            out.put_rows_of_token(self.r0, self.t0 + t, &vals);
        }
    }
}

/// A Q4_K tile's three scale words `a`, `b`, `c` (`gguf::k4_scale_min`, lane by lane for
/// sixteen rows): each row's scales 0..4 and 4..8, then its mins 0..4 and 4..8, a byte each.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) fn q4_k_scale_words(a: __m512i, b: __m512i, c: __m512i) -> [__m512i; 4] {
    let nibble = _mm512_set1_epi8(0x0f);
    let six = _mm512_set1_epi8(0x3f);
    let top = _mm512_set1_epi8(0x30);
    let sc_hi = _mm512_or_si512(
        _mm512_and_si512(c, nibble),
        _mm512_and_si512(_mm512_srli_epi32::<2>(a), top),
    );
    let m_hi = _mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi32::<4>(c), nibble),
        _mm512_and_si512(_mm512_srli_epi32::<2>(b), top),
    );
    [
        _mm512_and_si512(a, six),
        sc_hi,
        _mm512_and_si512(b, six),
        m_hi,
    ]
}

/// A Q6_K tile's quad `q` of a pass, from its words `ql0`, `ql1` (the low nibbles) and `h`
/// (the high bits): ggml's elements `128·half + 32k + 4q + (0..4)` of each row for
/// `k = 0..4`, as 0..63.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) fn q6_k_values(ql0: __m512i, ql1: __m512i, h: __m512i) -> [__m512i; 4] {
    let nibble = _mm512_set1_epi8(0x0f);
    let top = _mm512_set1_epi8(0x30);
    [
        _mm512_or_si512(
            _mm512_and_si512(ql0, nibble),
            _mm512_and_si512(_mm512_slli_epi16::<4>(h), top),
        ),
        _mm512_or_si512(
            _mm512_and_si512(ql1, nibble),
            _mm512_and_si512(_mm512_slli_epi16::<2>(h), top),
        ),
        _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(ql0), nibble),
            _mm512_and_si512(h, top),
        ),
        _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(ql1), nibble),
            _mm512_and_si512(_mm512_srli_epi16::<2>(h), top),
        ),
    ]
}

/// Sixteen rows' words `w0..w0 + 16` of a tile (`f16s` half-precision fields in front)
/// as rows: lane `k` of result `r` is row `r`'s word `w0 + k`. A 16 × 16 transposition of
/// `u32` in registers.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) fn transpose_words(tile: &[u8], f16s: usize, w0: usize) -> [__m512i; 16] {
    // v[k]: word w0 + k of the sixteen rows (lane r: row r).
    let v: [__m512i; 16] = std::array::from_fn(|k| word(tile, f16s, w0 + k, true));
    // Within each 128-bit quarter q: a[2i] = [v2i[4q], v2i+1[4q], v2i[4q+1], v2i+1[4q+1]],
    // a[2i + 1] the same for rows 4q + 2 and 4q + 3.
    let a: [__m512i; 16] = std::array::from_fn(|k| {
        let (x, y) = (v[k & !1], v[k | 1]);
        if k % 2 == 0 {
            _mm512_unpacklo_epi32(x, y)
        } else {
            _mm512_unpackhi_epi32(x, y)
        }
    });
    // b[4i + j], quarter q: row 4q + j's words 4i..4i + 4.
    let b: [__m512i; 16] = std::array::from_fn(|k| {
        let (i, j) = (k / 4, k % 4);
        let (x, y) = (a[4 * i + j / 2], a[4 * i + 2 + j / 2]);
        if j % 2 == 0 {
            _mm512_unpacklo_epi64(x, y)
        } else {
            _mm512_unpackhi_epi64(x, y)
        }
    });
    let mut rows = [_mm512_setzero_si512(); 16];
    for j in 0..4 {
        let c0 = _mm512_shuffle_i32x4::<0b01_00_01_00>(b[j], b[4 + j]);
        let c1 = _mm512_shuffle_i32x4::<0b11_10_11_10>(b[j], b[4 + j]);
        let c2 = _mm512_shuffle_i32x4::<0b01_00_01_00>(b[8 + j], b[12 + j]);
        let c3 = _mm512_shuffle_i32x4::<0b11_10_11_10>(b[8 + j], b[12 + j]);
        rows[j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(c0, c2);
        rows[4 + j] = _mm512_shuffle_i32x4::<0b11_01_11_01>(c0, c2);
        rows[8 + j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(c1, c3);
        rows[12 + j] = _mm512_shuffle_i32x4::<0b11_01_11_01>(c1, c3);
    }
    rows
}

/// Sixteen rows' words `w0..w0 + 16` of a tile put back in the rows ([`transpose_words`]):
/// row `r`'s sixteen words, 64 bytes, go to `out[r * stride + at..]`. (Products the
/// kernels here do not take rebuild ggml's blocks from the tiles; one copy per word and
/// row was a tenth of a Llama-3.2-1B-shaped prefill.)
///
/// # Safety
/// The CPU must support the features `super::cpu::wide_available` checks. Slices are
/// bounds-checked.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn untile_words(
    tile: &[u8],
    f16s: usize,
    w0: usize,
    out: &mut [u8],
    stride: usize,
    at: usize,
) {
    for (r, t) in transpose_words(tile, f16s, w0).into_iter().enumerate() {
        let dst = &mut out[r * stride + at..r * stride + at + 64];
        // SAFETY: `dst` is 64 writable bytes (sliced above); the store is unaligned.
        unsafe { _mm512_storeu_si512(dst.as_mut_ptr().cast(), t) };
    }
}
