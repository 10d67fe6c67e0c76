//! Register-tiled Q2_K and Q3_K prefill products for CPUs with AVX-512 (BW, VNNI), in
//! llama.cpp's eight lanes per token: two tokens per 512-bit register
//! (token `2k` of a tile in the low half, `2k + 1` in the high half), passes of two tiles of
//! 4 tokens (one at the end when the count of tiles is odd), two weight rows at a time. The
//! rows are unpacked once per product, in chunks that stay in L2, for all its passes.
//!
//! The integer lanes are `low_kquants`' exact `i32` lane sums (lane `i` of a token holding
//! elements `4i..4i + 4` of every 32-element chunk, times its group's scale). Each weight
//! is first replaced by its scaled value, looked up in a per-group table of the eight (Q3_K)
//! or four (Q2_K) values its quant can take: `sc·q` for Q2_K (0..=45), `sc·(q − 4) + 127`
//! for Q3_K (3..=255), so one unsigned byte. One `vpdpbusd` per 32 elements and token pair
//! then forms the lanes, where `maddubs` and `vpdpwssd` took two multiplies; Q3_K's `127`
//! comes back out as `127·Σa` over each lane's activations, which depends on the tokens
//! only and is formed once per pass. The float part is `Q2K::dot_with`'s or
//! `Q3K::dot_with`'s per token, lane for lane: the same `d_a · d_w` products (and Q2_K's
//! `-d_a · dmin_w`), the same fused multiply-adds into the same lanes in the same
//! super-block order, then `hsum8`; so each token gets exactly the 256-bit kernels' bits,
//! and llama.cpp's.

use std::arch::x86_64::*;

use super::avx2_low_kquants::q3_k_scale_bytes;
use super::tile_out::Out;
use crate::blocks::BlockQ8K;
use crate::blocks::TILE;

/// Bytes of one Q2_K super-block.
const Q2_K_BYTES: usize = 84;
/// Bytes of one Q3_K super-block.
const Q3_K_BYTES: usize = 110;

/// What Q3_K's table offset adds to each scaled weight (see the module comment).
const Q3_K_BIAS: i32 = 127;

/// Per super-block and tile, what the float part and the integer lanes need of the tile's
/// four tokens, built once per pass instead of once per weight row.
#[derive(Clone, Copy)]
struct LowActs {
    /// `[d0 x8, d1 x8]` and `[d2 x8, d3 x8]`: each token's scale over its eight lanes.
    d01: __m512,
    d23: __m512,
    /// Q2_K: tokens 0 and 1's `bsums` (256 bits each), and 2 and 3's.
    bsums: [__m512i; 2],
    /// Tokens 0 and 1's quants (`q[0]`), 2 and 3's (`q[1]`), 32 bytes of each a register.
    q: [[__m512i; 8]; 2],
    /// Q3_K: `127·Σa` over each lane's 32 activations, for tokens 0 and 1 and for 2 and 3:
    /// what the tables' offset adds to every row's lanes.
    bias: [__m512i; 2],
}

/// How many bytes of scaled weights one product unpacks at a time: rows are unpacked in
/// chunks of about this size (L2-resident), and each chunk meets every pass of tokens.
const SCALED_BYTES_PER_CHUNK: usize = 256 * 1024;

/// Rows with every weight replaced by its scaled byte (see the module comment), unpacked
/// once per product and chunk of rows instead of once per pass of tokens.
#[derive(Default)]
struct ScaledRows {
    /// Per row and super-block (`r * nb + i`), its eight 32-element chunks.
    bytes: Vec<[u8; 256]>,
    /// Per row and super-block: `d_w`, and Q2_K's `-dmin_w`.
    d: Vec<[f32; 2]>,
    /// Q2_K, per row and super-block: the sixteen group minimums.
    mins: Vec<[i16; 16]>,
}

/// Q2_K (`two`) or Q3_K rows (`w` ggml's super-blocks as bytes, `nb` a row) against the
/// whole tiles of the `n` tokens, into `out`; returns how many tokens it did (a
/// multiple of [`TILE`]); the caller does the rest with the 256-bit kernel.
///
/// # Safety
/// The CPU must support the features `super::cpu::wide_available` checks, and F16C.
/// Slices are bounds-checked.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn low_k_quant_tiles(
    w: &[u8],
    nb: usize,
    x: &[BlockQ8K],
    n: usize,
    two: bool,
    out: &mut Out<'_>,
) -> usize {
    if two {
        tiles::<true>(w, nb, x, n, out)
    } else {
        tiles::<false>(w, nb, x, n, out)
    }
}

/// [`low_k_quant_tiles`] into a row-major block, `out[r * n + t]`: all `n` tokens past a
/// tile (padded to whole tiles, `super::x86_512::padded_to_tiles`), else the whole tiles;
/// returns how many it did.
///
/// # Safety
/// As [`low_k_quant_tiles`].
pub unsafe fn low_k_quant_rows(
    w: &[u8],
    nb: usize,
    x: &[BlockQ8K],
    n: usize,
    two: bool,
    out: &mut [f32],
) -> usize {
    // SAFETY (both calls): the caller guarantees the CPU features, the function's only
    // requirement.
    let padded = super::x86_512::padded_to_tiles(x, nb, n, out, |xp, np, wide| unsafe {
        low_k_quant_tiles(w, nb, xp, np, two, &mut Out::RowMajor { out: wide, n: np });
    });
    if padded {
        return n;
    }
    unsafe { low_k_quant_tiles(w, nb, x, n, two, &mut Out::RowMajor { out, n }) }
}

/// [`low_k_quant_tiles`] straight into token-major `out[t * ld + r]`, where `n` is whole
/// tiles; false (nothing done) where not.
///
/// # Safety
/// As [`low_k_quant_tiles`].
pub unsafe fn low_k_quant_token_major(
    w: &[u8],
    nb: usize,
    x: &[BlockQ8K],
    n: usize,
    two: bool,
    out: &mut [f32],
    ld: usize,
) -> bool {
    if !n.is_multiple_of(TILE) {
        return false;
    }
    // SAFETY: the caller guarantees the CPU features, the function's only requirement.
    unsafe { low_k_quant_tiles(w, nb, x, n, two, &mut Out::TokenMajor { out, ld }) };
    true
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn tiles<const TWO: bool>(
    w: &[u8],
    nb: usize,
    x: &[BlockQ8K],
    n: usize,
    out: &mut Out<'_>,
) -> usize {
    let tiles = n / TILE;
    let rb = nb * if TWO { Q2_K_BYTES } else { Q3_K_BYTES };
    let nr = w.len() / rb;
    let chunk_rows = (SCALED_BYTES_PER_CHUNK / (256 * nb)).max(2);
    let mut scaled = ScaledRows::default();
    let mut prep = Vec::with_capacity(2 * nb);
    for r0 in (0..nr).step_by(chunk_rows) {
        let rows = chunk_rows.min(nr - r0);
        scaled.fill::<TWO>(&w[r0 * rb..(r0 + rows) * rb]);
        let mut tile = 0;
        while tile < tiles {
            let p = if tile + 2 <= tiles { 2 } else { 1 };
            if p == 2 {
                pass::<2, TWO>(&scaled, r0, rows, nb, x, tile, &mut prep, out);
            } else {
                pass::<1, TWO>(&scaled, r0, rows, nb, x, tile, &mut prep, out);
            }
            tile += p;
        }
    }
    tiles * TILE
}

impl ScaledRows {
    /// Unpacks `w` (whole rows of Q2_K or Q3_K super-blocks) in place of the last chunk.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn fill<const TWO: bool>(&mut self, w: &[u8]) {
        self.bytes.clear();
        self.d.clear();
        self.mins.clear();
        if TWO {
            for wb in w.chunks_exact(Q2_K_BYTES) {
                let dd = f16_pair(wb, 80);
                // `-d_a · dmin_w` is `-(d_a · dmin_w)` whichever factor carries the sign.
                self.d
                    .push([_mm_cvtss_f32(dd), -_mm_cvtss_f32(_mm_movehdup_ps(dd))]);
                self.mins
                    .push(std::array::from_fn(|g| i16::from(wb[g] >> 4)));
                self.bytes.push(scaled_q2_k(wb));
            }
        } else {
            for wb in w.chunks_exact(Q3_K_BYTES) {
                let h = u16::from_le_bytes([wb[108], wb[109]]);
                let dw = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))));
                self.d.push([dw, 0.0]);
                self.bytes.push(scaled_q3_k(wb));
            }
        }
    }
}

/// Stores the low 256 bits of each chunk's scaled weights (both halves are the same).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn store_chunk(out: &mut [u8; 256], c: usize, scaled: __m512i) {
    let dst = &mut out[32 * c..32 * c + 32];
    // SAFETY: `dst` is 32 writable bytes (sliced above); the store is unaligned.
    unsafe { _mm256_storeu_si256(dst.as_mut_ptr().cast(), _mm512_castsi512_si256(scaled)) };
}

/// One Q2_K super-block's weights as `sc·q` bytes, chunk by chunk.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn scaled_q2_k(wb: &[u8]) -> [u8; 256] {
    let sm = &wb[..16];
    // SAFETY: `sm` is 16 readable bytes; the load is unaligned.
    let packed = unsafe { _mm_loadu_si128(sm.as_ptr().cast()) };
    let tables = group_tables::<true>(_mm_and_si128(packed, _mm_set1_epi8(0x0f)));
    let mut out = [0u8; 256];
    for half in 0..2 {
        let fields = two_bit_fields(both_halves(wb, 16 + 32 * half));
        for (k, &f) in fields.iter().enumerate() {
            let c = 4 * half + k;
            store_chunk(
                &mut out,
                c,
                _mm512_shuffle_epi8(chunk_tables(&tables, c), f),
            );
        }
    }
    out
}

/// One Q3_K super-block's weights as `sc·(q − 4) + 127` bytes, chunk by chunk.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn scaled_q3_k(wb: &[u8]) -> [u8; 256] {
    let four = _mm512_set1_epi8(4);
    let tables = group_tables::<false>(q3_k_scale_bytes(&wb[96..108]));
    let hm = both_halves(wb, 0);
    let mut out = [0u8; 256];
    for half in 0..2 {
        let fields = two_bit_fields(both_halves(wb, 32 + 32 * half));
        for (k, &f) in fields.iter().enumerate() {
            let c = 4 * half + k;
            // Element `32c + l`'s high bit is bit `c` of `hmask[l]`.
            let high = _mm512_test_epi8_mask(hm, _mm512_set1_epi8((1u8 << c) as i8));
            let q = _mm512_mask_add_epi8(f, high, f, four);
            store_chunk(
                &mut out,
                c,
                _mm512_shuffle_epi8(chunk_tables(&tables, c), q),
            );
        }
    }
    out
}

/// The chunk's rows `r0 + ..rows` (of the product) against tiles `tile..tile + P`, two rows
/// at a time.
// The arguments are the pass's coordinates; a struct for them would only be unpacked here.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn pass<const P: usize, const TWO: bool>(
    scaled: &ScaledRows,
    r0: usize,
    rows: usize,
    nb: usize,
    x: &[BlockQ8K],
    tile: usize,
    prep: &mut Vec<LowActs>,
    out: &mut Out<'_>,
) {
    let t0 = tile * TILE;
    let acts: [[&[BlockQ8K]; TILE]; P] = std::array::from_fn(|p| {
        std::array::from_fn(|j| &x[(t0 + p * TILE + j) * nb..(t0 + p * TILE + j + 1) * nb])
    });
    prep.clear();
    for i in 0..nb {
        for tile_acts in &acts {
            prep.push(low_acts_of::<TWO>(std::array::from_fn(|j| {
                &tile_acts[j][i]
            })));
        }
    }
    let mut r = 0;
    while r < rows {
        if r + 2 <= rows {
            let res = scaled_rows::<2, P, TWO>(scaled, r, nb, prep);
            for (m, row) in res.iter().enumerate() {
                for (p, part) in row.iter().enumerate() {
                    out.put_slice(r0 + r + m, t0 + p * TILE, part);
                }
            }
            r += 2;
        } else {
            let [row] = scaled_rows::<1, P, TWO>(scaled, r, nb, prep);
            for (p, part) in row.iter().enumerate() {
                out.put_slice(r0 + r, t0 + p * TILE, part);
            }
            r += 1;
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn low_acts_of<const TWO: bool>(a: [&BlockQ8K; TILE]) -> LowActs {
    let d: [f32; 16] = std::array::from_fn(|l| a[l / 8].d);
    let d2: [f32; 16] = std::array::from_fn(|l| a[2 + l / 8].d);
    let loadps = |v: &[f32; 16]| {
        // SAFETY: `v` is 16 readable f32; the load is unaligned.
        unsafe { _mm512_loadu_ps(v.as_ptr()) }
    };
    let b = |t: usize| {
        // SAFETY: `bsums` is 16 readable i16 (32 bytes); the load is unaligned.
        unsafe { _mm256_loadu_si256(a[t].bsums.as_ptr().cast()) }
    };
    let bsums = if TWO {
        [
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(b(0)), b(1)),
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(b(2)), b(3)),
        ]
    } else {
        [_mm512_setzero_si512(); 2]
    };
    let q: [[__m512i; 8]; 2] = std::array::from_fn(|h| {
        std::array::from_fn(|c| pair(&a[2 * h].qs, &a[2 * h + 1].qs, 32 * c))
    });
    let bias = if TWO {
        [_mm512_setzero_si512(); 2]
    } else {
        let ones = _mm512_set1_epi8(1);
        // Each lane at most 32 · 128 in magnitude before the multiply by 127: exact.
        q.map(|h| {
            let sums = h.iter().fold(_mm512_setzero_si512(), |acc, &v| {
                _mm512_dpbusd_epi32(acc, ones, v)
            });
            _mm512_mullo_epi32(sums, _mm512_set1_epi32(Q3_K_BIAS))
        })
    };
    LowActs {
        d01: loadps(&d),
        d23: loadps(&d2),
        bsums,
        q,
        bias,
    }
}

/// `acc[h] = fma(d_a * d_w, f32(lanes[h]), acc[h])` for a tile's two token pairs, with
/// `d` the tile's `[d0 x8, d1 x8]`, `[d2 x8, d3 x8]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn scale_lanes(acc: &mut [__m512; 2], d: [__m512; 2], dw: __m512, lanes: [__m512i; 2]) {
    for h in 0..2 {
        acc[h] = _mm512_fmadd_ps(
            _mm512_mul_ps(d[h], dw),
            _mm512_cvtepi32_ps(lanes[h]),
            acc[h],
        );
    }
}

/// The sixteen groups' tables of scaled weights, eight bytes each (entry `k` the value of
/// quant `k`): group `g`'s is qword `g % 8` of `[g / 8]`. `scales` holds the sixteen group
/// scales as bytes: Q2_K's in 0..16, Q3_K's signed in -32..32. Byte arithmetic wraps, and
/// every entry's true value fits an unsigned byte (see the module comment), so the wrapped
/// sums are exact.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn group_tables<const TWO: bool>(scales: __m128i) -> [__m512i; 2] {
    let all = _mm512_broadcast_i32x4(scales);
    // Byte j of 128-bit lane l takes group 2l + j / 8 (plus 8 for the second register).
    let spread = |first: i8| {
        let pick: [i8; 64] = std::array::from_fn(|b| first + (2 * (b / 16) + (b % 16) / 8) as i8);
        // SAFETY: `pick` is 64 readable bytes; the load is unaligned.
        _mm512_shuffle_epi8(all, unsafe { _mm512_loadu_si512(pick.as_ptr().cast()) })
    };
    // Entries whose quant has bit 0, 1, 2 set: byte k of each qword has quant k.
    const BIT0: u64 = 0xaaaa_aaaa_aaaa_aaaa;
    const BIT1: u64 = 0xcccc_cccc_cccc_cccc;
    const BIT2: u64 = 0xf0f0_f0f0_f0f0_f0f0;
    [spread(0), spread(8)].map(|s1| {
        let s2 = _mm512_add_epi8(s1, s1);
        let t = _mm512_maskz_mov_epi8(BIT0, s1);
        let t = _mm512_mask_add_epi8(t, BIT1, t, s2);
        if TWO {
            t
        } else {
            // `127 − 4·sc + q·sc`: `q − 4` scaled, offset into 3..=255.
            let s4 = _mm512_add_epi8(s2, s2);
            let t = _mm512_mask_add_epi8(t, BIT2, t, s4);
            _mm512_add_epi8(t, _mm512_sub_epi8(_mm512_set1_epi8(Q3_K_BIAS as i8), s4))
        }
    })
}

/// Chunk `c`'s tables for `vpshufb`: group `2c` in the low qword of the 128-bit lanes that
/// hold the chunk's first 16 elements (0 and 2), group `2c + 1` in those of the others.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn chunk_tables(tables: &[__m512i; 2], c: usize) -> __m512i {
    let (g0, g1) = ((2 * c % 8) as i64, (2 * c % 8 + 1) as i64);
    _mm512_permutexvar_epi64(
        _mm512_set_epi64(g1, g1, g0, g0, g1, g1, g0, g0),
        tables[c / 4],
    )
}

/// The four 2-bit fields of each byte of `q`, lowest first. A 16-bit shift moves the upper
/// byte's bits into the lower byte's top, which the mask drops.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn two_bit_fields(q: __m512i) -> [__m512i; 4] {
    let m3 = _mm512_set1_epi8(3);
    [
        _mm512_and_si512(q, m3),
        _mm512_and_si512(_mm512_srli_epi16::<2>(q), m3),
        _mm512_and_si512(_mm512_srli_epi16::<4>(q), m3),
        _mm512_and_si512(_mm512_srli_epi16::<6>(q), m3),
    ]
}

/// `M` unpacked rows from `r` (of the chunk) against `P` tiles: `[row][tile][token]`. Per
/// super-block, Q2_K's eight min-term lanes per token (`m_2i·bsums_2i +
/// m_2i+1·bsums_2i+1`) go in first with `-d_a·dmin_w`, then the scaled sums with
/// `d_a·d_w`, as `Q2K::dot_with` and `Q3K::dot_with`.
// Indexed loops: as in `x86_512_kquants.rs`, iterators inline worse here.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn scaled_rows<const M: usize, const P: usize, const TWO: bool>(
    scaled: &ScaledRows,
    r: usize,
    nb: usize,
    prep: &[LowActs],
) -> [[[f32; TILE]; P]; M] {
    let mut acc = [[[_mm512_setzero_ps(); 2]; P]; M];
    for i in 0..nb {
        let at: [usize; M] = std::array::from_fn(|m| (r + m) * nb + i);
        if TWO {
            for m in 0..M {
                let mins = &scaled.mins[at[m]];
                // SAFETY: `mins` is 32 readable bytes; the load is unaligned.
                let mins =
                    _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(mins.as_ptr().cast()) });
                let neg_dm = _mm512_set1_ps(scaled.d[at[m]][1]);
                for p in 0..P {
                    let ta = &prep[i * P + p];
                    // Each lane `m·bsums + m·bsums` is within ±2·15·4,096: exact.
                    let lanes = [
                        _mm512_madd_epi16(ta.bsums[0], mins),
                        _mm512_madd_epi16(ta.bsums[1], mins),
                    ];
                    scale_lanes(&mut acc[m][p], [ta.d01, ta.d23], neg_dm, lanes);
                }
            }
        }
        let bytes: [&[u8; 256]; M] = std::array::from_fn(|m| &scaled.bytes[at[m]]);
        let mut lanes = [[[_mm512_setzero_si512(); 2]; P]; M];
        for c in 0..8 {
            let w: [__m512i; M] = std::array::from_fn(|m| both_halves(bytes[m], 32 * c));
            for p in 0..P {
                let ta = &prep[i * P + p];
                for h in 0..2 {
                    let a = ta.q[h][c];
                    for m in 0..M {
                        // Each lane at most 32 · 255 · 128 in magnitude: exact.
                        lanes[m][p][h] = _mm512_dpbusd_epi32(lanes[m][p][h], w[m], a);
                    }
                }
            }
        }
        for m in 0..M {
            let dw = _mm512_set1_ps(scaled.d[at[m]][0]);
            for p in 0..P {
                let ta = &prep[i * P + p];
                if !TWO {
                    for h in 0..2 {
                        lanes[m][p][h] = _mm512_sub_epi32(lanes[m][p][h], ta.bias[h]);
                    }
                }
                scale_lanes(&mut acc[m][p], [ta.d01, ta.d23], dw, lanes[m][p]);
            }
        }
    }
    std::array::from_fn(|m| std::array::from_fn(|p| finish(acc[m][p], None)))
}

/// Bytes `at..at + 32` of two tokens' quants, the first in the low half.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn pair(a: &[i8; 256], b: &[i8; 256], at: usize) -> __m512i {
    let (a, b) = (&a[at..at + 32], &b[at..at + 32]);
    // SAFETY: `a` and `b` are 32 readable bytes each (sliced above); the loads are unaligned.
    unsafe {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_loadu_si256(a.as_ptr().cast())),
            _mm256_loadu_si256(b.as_ptr().cast()),
        )
    }
}

/// 32 bytes of `b` from `at`, in both halves.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn both_halves(b: &[u8], at: usize) -> __m512i {
    let s = &b[at..at + 32];
    // SAFETY: `s` is 32 readable bytes (sliced above); the load is unaligned.
    _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(s.as_ptr().cast()) })
}

/// The f16s at `b[at..at + 4]` as f32s, in the low two lanes (exact conversions).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn f16_pair(b: &[u8], at: usize) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes([
        b[at],
        b[at + 1],
        b[at + 2],
        b[at + 3],
    ])))
}

/// The four tokens' results from two lane accumulators `[t0 | t1]`, `[t2 | t3]`, each
/// summed as `low_kquants::hsum8`, plus (the low k-quants) each token's four min-term lanes
/// summed as their `dot_with` does.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn finish(acc: [__m512; 2], acc_m: Option<__m512>) -> [f32; TILE] {
    // Every addition keeps the scalar definitions' operands and their order (first operand
    // first, as NaN payloads depend on it), four tokens at once: the 128-bit units of
    // `acc` are `[t0 lanes 0..4, t0 4..8, t1 0..4, t1 4..8]` and `[t2 .., t3 ..]`.
    let low = _mm512_shuffle_f32x4::<0b10_00_10_00>(acc[0], acc[1]);
    let high = _mm512_shuffle_f32x4::<0b11_01_11_01>(acc[0], acc[1]);
    // `r[j] = acc[4 + j] + acc[j]`, one unit per token.
    let r = _mm512_add_ps(high, low);
    // `(v[0] + v[2]) + (v[1] + v[3])` in lane 0 of each unit.
    let quad = |v: __m512| {
        let s = _mm512_add_ps(v, _mm512_permute_ps::<0b01_00_11_10>(v));
        _mm512_add_ps(s, _mm512_permute_ps::<0b10_11_00_01>(s))
    };
    let mut sums = quad(r);
    if let Some(m) = acc_m {
        sums = _mm512_add_ps(sums, quad(m));
    }
    let firsts = _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
        sums,
    );
    let mut out = [0f32; TILE];
    // SAFETY: `out` is 4 writable f32; the store is unaligned.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), _mm512_castps512_ps128(firsts)) };
    out
}
