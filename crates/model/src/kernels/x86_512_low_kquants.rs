//! Register-tiled Q2_K and Q3_K prefill products for CPUs with AVX-512 (BW, VNNI), laid
//! out as `x86_512_kquants.rs`'s Q4_K and Q6_K tiles: two tokens per 512-bit register
//! (token `2k` of a tile in the low half, `2k + 1` in the high half), each super-block
//! unpacked once for two tiles of 4 tokens (one at the end when the count of tiles is
//! odd), one weight row at a time.
//!
//! The integer lanes are `low_kquants`' exact `i32` lane sums (lane `i` of a token holding
//! elements `4i..4i + 4` of every 32-element chunk, times its group's scale), formed with
//! `vpdpwssd`. The float part is `Q2K::dot_with`'s or `Q3K::dot_with`'s per token, lane
//! for lane: the same `d_a · d_w` products (and Q2_K's `-d_a · dmin_w`), the same fused
//! multiply-adds into the same lanes in the same super-block order, then `hsum8`; so each
//! token gets exactly the 256-bit kernels' bits, and llama.cpp's.

use std::arch::x86_64::*;

use super::x86_512::Out;
use super::x86_512_kquants::{both_halves, f16_pair, finish, pair};
use super::TILE;
use crate::low_kquants::simd::q3_k_scales_i16 as q3_k_scales;
use crate::quant::BlockQ8K;

/// Bytes of one Q2_K super-block.
const Q2_K_BYTES: usize = 84;
/// Bytes of one Q3_K super-block.
const Q3_K_BYTES: usize = 110;

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
    /// Q3_K: `4·(a_2k + a_2k+1)` as `i16` for each register of `q`: what Q3_K's `-4`
    /// offset takes from each `maddubs` pair. It does not depend on the weights, so
    /// subtracting it here saves llama.cpp's second `maddubs` on every row.
    four: [[__m512i; 8]; 2],
}

/// Q2_K (`two`) or Q3_K rows (`w` ggml's super-blocks as bytes, `nb` a row) against the
/// whole tiles of the `n` tokens, into `out`; returns how many tokens it did (a
/// multiple of [`TILE`]); the caller does the rest with the 256-bit kernel.
///
/// # Safety
/// The CPU must support the features `super::x86_512::available` checks, and F16C.
/// Slices are bounds-checked.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn low_k_quant_tiles(
    w: &[u8],
    nb: usize,
    x: &[BlockQ8K],
    n: usize,
    two: bool,
    out: &mut Out<'_>,
) -> usize {
    let tiles = n / TILE;
    let mut prep = Vec::with_capacity(2 * nb);
    let mut tile = 0;
    while tile < tiles {
        let p = if tile + 2 <= tiles { 2 } else { 1 };
        match (p, two) {
            (2, true) => pass::<2, true>(w, nb, x, tile, &mut prep, out),
            (2, false) => pass::<2, false>(w, nb, x, tile, &mut prep, out),
            (_, true) => pass::<1, true>(w, nb, x, tile, &mut prep, out),
            (_, false) => pass::<1, false>(w, nb, x, tile, &mut prep, out),
        }
        tile += p;
    }
    tiles * TILE
}

/// Every row against tiles `tile..tile + P`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn pass<const P: usize, const TWO: bool>(
    w: &[u8],
    nb: usize,
    x: &[BlockQ8K],
    tile: usize,
    prep: &mut Vec<LowActs>,
    out: &mut Out<'_>,
) {
    let rb = nb * if TWO { Q2_K_BYTES } else { Q3_K_BYTES };
    let nr = w.len() / rb;
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
    for r in 0..nr {
        let row = &w[r * rb..(r + 1) * rb];
        let res = if TWO {
            q2_k_row::<P>(row, prep)
        } else {
            q3_k_row::<P>(row, prep)
        };
        for (p, part) in res.iter().enumerate() {
            out.put_slice(r, t0 + p * TILE, part);
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
    let four = if TWO {
        [[_mm512_setzero_si512(); 8]; 2]
    } else {
        // At most 2 · 4 · 128 in magnitude: never saturates.
        let f = _mm512_set1_epi8(4);
        q.map(|h| h.map(|v| _mm512_maddubs_epi16(f, v)))
    };
    LowActs {
        d01: loadps(&d),
        d23: loadps(&d2),
        bsums,
        q,
        four,
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

/// The sixteen group scales as `i16` in both halves, and the index vectors that pick, for
/// chunk `c`, group `2c` into the low 128 bits of each half and `2c + 1` into the high ones
/// (the groups of `maddubs`' pairs there).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn chunk_scales(sc_all: __m512i, c: usize) -> __m512i {
    let groups = _mm512_set_epi64(
        0x0001_0001_0001_0001,
        0x0001_0001_0001_0001,
        0,
        0,
        0x0001_0001_0001_0001,
        0x0001_0001_0001_0001,
        0,
        0,
    );
    _mm512_permutexvar_epi16(
        _mm512_add_epi16(groups, _mm512_set1_epi16(2 * c as i16)),
        sc_all,
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

/// One Q2_K row against `P` tiles: `[tile][token]`. Per super-block, each token's eight
/// min-term lanes (`m_2i·bsums_2i + m_2i+1·bsums_2i+1`) go in first with `-d_a·dmin_w`,
/// then the scaled sums with `d_a·d_w`, as `Q2K::dot_with`.
// Indexed loops: as in `x86_512_kquants.rs`, iterators inline worse here.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q2_k_row<const P: usize>(row: &[u8], prep: &[LowActs]) -> [[f32; TILE]; P] {
    let mut acc = [[_mm512_setzero_ps(); 2]; P];
    for (i, wb) in row.chunks_exact(Q2_K_BYTES).enumerate() {
        let dd = f16_pair(wb, 80);
        let dw = _mm512_set1_ps(_mm_cvtss_f32(dd));
        // `-d_a · dmin_w` is `-(d_a · dmin_w)` whichever factor carries the sign.
        let neg_dm = _mm512_set1_ps(-_mm_cvtss_f32(_mm_movehdup_ps(dd)));
        let sm = &wb[..16];
        // SAFETY: `sm` is 16 readable bytes; the load is unaligned.
        let packed = unsafe { _mm_loadu_si128(sm.as_ptr().cast()) };
        let sc_all = _mm512_broadcast_i64x4(_mm256_cvtepu8_epi16(_mm_and_si128(
            packed,
            _mm_set1_epi8(0x0f),
        )));
        let mins = _mm512_broadcast_i64x4(_mm256_cvtepu8_epi16(_mm_and_si128(
            _mm_srli_epi16::<4>(packed),
            _mm_set1_epi8(0x0f),
        )));
        for p in 0..P {
            let ta = &prep[i * P + p];
            // Each lane `m·bsums + m·bsums` is within ±2·15·4,096: exact.
            let m = [
                _mm512_madd_epi16(ta.bsums[0], mins),
                _mm512_madd_epi16(ta.bsums[1], mins),
            ];
            scale_lanes(&mut acc[p], [ta.d01, ta.d23], neg_dm, m);
        }
        let mut lanes = [[_mm512_setzero_si512(); 2]; P];
        for half in 0..2 {
            let fields = two_bit_fields(both_halves(wb, 16 + 32 * half));
            for k in 0..4 {
                let c = 4 * half + k;
                let scales = chunk_scales(sc_all, c);
                for p in 0..P {
                    let ta = &prep[i * P + p];
                    for h in 0..2 {
                        // At most 2 · 3 · 128 in magnitude: never saturates.
                        let x = _mm512_maddubs_epi16(fields[k], ta.q[h][c]);
                        lanes[p][h] = _mm512_dpwssd_epi32(lanes[p][h], x, scales);
                    }
                }
            }
        }
        for p in 0..P {
            let ta = &prep[i * P + p];
            scale_lanes(&mut acc[p], [ta.d01, ta.d23], dw, lanes[p]);
        }
    }
    std::array::from_fn(|p| finish(acc[p], None))
}

/// One Q3_K row against `P` tiles: `[tile][token]`. Each value `q − 4` is formed as
/// `maddubs(q, a) − 4·(a + a')` per pair (`q` in 0..8: the low bits with the high bit as
/// 4), exact `i16`s equal to llama.cpp's `maddubs(low, a) − maddubs(4·!high, a)`.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q3_k_row<const P: usize>(row: &[u8], prep: &[LowActs]) -> [[f32; TILE]; P] {
    let mut acc = [[_mm512_setzero_ps(); 2]; P];
    let four = _mm512_set1_epi8(4);
    for (i, wb) in row.chunks_exact(Q3_K_BYTES).enumerate() {
        let h = u16::from_le_bytes([wb[108], wb[109]]);
        let dw = _mm512_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h)))));
        let sc_all = _mm512_broadcast_i64x4(q3_k_scales(&wb[96..108]));
        let hm = both_halves(wb, 0);
        let mut lanes = [[_mm512_setzero_si512(); 2]; P];
        for half in 0..2 {
            let fields = two_bit_fields(both_halves(wb, 32 + 32 * half));
            for k in 0..4 {
                let c = 4 * half + k;
                // Element `32c + l`'s high bit is bit `c` of `hmask[l]`.
                let high = _mm512_test_epi8_mask(hm, _mm512_set1_epi8((1u8 << c) as i8));
                let q = _mm512_mask_add_epi8(fields[k], high, fields[k], four);
                let scales = chunk_scales(sc_all, c);
                for p in 0..P {
                    let ta = &prep[i * P + p];
                    for h in 0..2 {
                        // `maddubs` at most 2 · 7 · 128, the difference within ±2,816.
                        let x =
                            _mm512_sub_epi16(_mm512_maddubs_epi16(q, ta.q[h][c]), ta.four[h][c]);
                        lanes[p][h] = _mm512_dpwssd_epi32(lanes[p][h], x, scales);
                    }
                }
            }
        }
        for p in 0..P {
            let ta = &prep[i * P + p];
            scale_lanes(&mut acc[p], [ta.d01, ta.d23], dw, lanes[p]);
        }
    }
    std::array::from_fn(|p| finish(acc[p], None))
}
