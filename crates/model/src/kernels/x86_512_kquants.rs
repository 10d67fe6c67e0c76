//! Register-tiled Q6_K prefill products for CPUs with AVX-512 (BW, VNNI): two
//! tokens per 512-bit register (token `2k` of a tile in the low half, `2k + 1` in the
//! high half), each super-block unpacked once for two tiles of 4 tokens (one at the end
//! when the count of tiles is odd), one weight row at a time. On Zen 5 two rows per pass
//! (sharing each activation register) and four tiles per pass both measured no faster.
//! (Q4_K has its own arithmetic and kernel: `x86_512_lanes.rs`.)
//!
//! The integer lanes are the 256-bit kernel's (`avx2_kquants::q6_k_lanes_n`) exact `i32`
//! sums, formed with `vpdpwssd` (the scale multiply-add and the accumulation in one
//! instruction, exact: no saturation, and far from overflow). The float part is
//! `Q6K::dot_with`'s per token, lane for lane: the same `d_a · d_w` products, the same
//! fused multiply-adds into the same lanes in the same super-block order, the same final
//! sums; so every token gets exactly the 256-bit kernels' bits, and llama.cpp's.

use std::arch::x86_64::*;

use super::tile_out::Out;
use crate::blocks::BlockQ8K;
use crate::blocks::TILE;

/// Per super-block and tile, what the float part needs of the tile's four tokens, built
/// once per pass instead of once per weight row.
#[derive(Clone, Copy)]
struct TileActs {
    /// `[d0 x8, d1 x8]` and `[d2 x8, d3 x8]`: each token's scale over its eight lanes.
    d01: __m512,
    d23: __m512,
    /// Tokens 0 and 1's `bsums` (256 bits each).
    s0: __m512i,
    /// Tokens 2 and 3's `bsums`.
    s1: __m512i,
    /// Tokens 0 and 1's quants (`q[0]`), 2 and 3's (`q[1]`), 32 bytes of each a register:
    /// interleaved once per pass, so each row's products load one register where they
    /// would otherwise load two halves and join them.
    q: [[__m512i; 8]; 2],
}

/// Q6_K rows (`w` ggml's super-blocks as bytes, `nb` a row) against
/// the whole tiles of the `n` tokens, into `out`; returns how many tokens it did (a
/// multiple of [`TILE`]); the caller does the rest with the 256-bit kernel.
///
/// # Safety
/// The CPU must support the features `super::cpu::wide_available` checks, and F16C.
/// Slices are bounds-checked.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn k_quant_tiles(
    w: &[u8],
    nb: usize,
    x: &[BlockQ8K],
    n: usize,
    out: &mut Out<'_>,
) -> usize {
    let tiles = n / TILE;
    let mut prep = Vec::with_capacity(2 * nb);
    let mut tile = 0;
    while tile < tiles {
        let p = if tile + 2 <= tiles { 2 } else { 1 };
        match p {
            2 => pass::<2>(w, nb, x, tile, &mut prep, out),
            _ => pass::<1>(w, nb, x, tile, &mut prep, out),
        }
        tile += p;
    }
    tiles * TILE
}

/// [`k_quant_tiles`] into a row-major block, `out[r * n + t]`: all `n` tokens past a tile
/// (padded to whole tiles, `super::x86_512::padded_to_tiles`), else the whole tiles;
/// returns how many it did.
///
/// # Safety
/// As [`k_quant_tiles`].
pub unsafe fn k_quant_rows(
    w: &[u8],
    nb: usize,
    x: &[BlockQ8K],
    n: usize,
    out: &mut [f32],
) -> usize {
    // SAFETY (both calls): the caller guarantees the CPU features, the function's only
    // requirement.
    let padded = super::x86_512::padded_to_tiles(x, nb, n, out, |xp, np, wide| unsafe {
        k_quant_tiles(w, nb, xp, np, &mut Out::RowMajor { out: wide, n: np });
    });
    if padded {
        return n;
    }
    unsafe { k_quant_tiles(w, nb, x, n, &mut Out::RowMajor { out, n }) }
}

/// [`k_quant_tiles`] straight into token-major `out[t * ld + r]`, where `n` is whole tiles;
/// false (nothing done) where not.
///
/// # Safety
/// As [`k_quant_tiles`].
pub unsafe fn k_quant_token_major(
    w: &[u8],
    nb: usize,
    x: &[BlockQ8K],
    n: usize,
    out: &mut [f32],
    ld: usize,
) -> bool {
    if !n.is_multiple_of(TILE) {
        return false;
    }
    // SAFETY: the caller guarantees the CPU features, the function's only requirement.
    unsafe { k_quant_tiles(w, nb, x, n, &mut Out::TokenMajor { out, ld }) };
    true
}

/// Every row against tiles `tile..tile + P`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn pass<const P: usize>(
    w: &[u8],
    nb: usize,
    x: &[BlockQ8K],
    tile: usize,
    prep: &mut Vec<TileActs>,
    out: &mut Out<'_>,
) {
    let rb = nb * 210;
    let nr = w.len() / rb;
    let t0 = tile * TILE;
    let acts: [[&[BlockQ8K]; TILE]; P] = std::array::from_fn(|p| {
        std::array::from_fn(|j| &x[(t0 + p * TILE + j) * nb..(t0 + p * TILE + j + 1) * nb])
    });
    prep.clear();
    for i in 0..nb {
        for tile_acts in &acts {
            prep.push(tile_acts_of(std::array::from_fn(|j| &tile_acts[j][i])));
        }
    }
    for r in 0..nr {
        let row = &w[r * rb..(r + 1) * rb];
        let res = q6_k_row::<P>(row, prep);
        for (p, part) in res.iter().enumerate() {
            out.put_slice(r, t0 + p * TILE, part);
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn tile_acts_of(a: [&BlockQ8K; TILE]) -> TileActs {
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
    let q = std::array::from_fn(|h| {
        std::array::from_fn(|c| pair(&a[2 * h].qs, &a[2 * h + 1].qs, 32 * c))
    });
    TileActs {
        q,
        d01: loadps(&d),
        d23: loadps(&d2),
        s0: _mm512_inserti64x4::<1>(_mm512_castsi256_si512(b(0)), b(1)),
        s1: _mm512_inserti64x4::<1>(_mm512_castsi256_si512(b(2)), b(3)),
    }
}

/// Bytes `at..at + 32` of two tokens' quants, the first in the low half.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) fn pair(a: &[i8; 256], b: &[i8; 256], at: usize) -> __m512i {
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
pub(super) fn both_halves(b: &[u8], at: usize) -> __m512i {
    let s = &b[at..at + 32];
    // SAFETY: `s` is 32 readable bytes (sliced above); the load is unaligned.
    _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(s.as_ptr().cast()) })
}

/// The f16s at `b[at..at + 4]` as f32s, in the low two lanes (exact conversions).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) fn f16_pair(b: &[u8], at: usize) -> __m128 {
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
pub(super) fn finish(acc: [__m512; 2], acc_m: Option<__m512>) -> [f32; TILE] {
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

/// `acc[h] = fma(d_a * d_w, f32(lanes[h]), acc[h])` for a tile's two token pairs: the float
/// step `Q6K::dot_with` takes per super-block, on every lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn scale_lanes(acc: &mut [__m512; 2], ta: &TileActs, dw: __m512, lanes: [__m512i; 2]) {
    acc[0] = _mm512_fmadd_ps(
        _mm512_mul_ps(ta.d01, dw),
        _mm512_cvtepi32_ps(lanes[0]),
        acc[0],
    );
    acc[1] = _mm512_fmadd_ps(
        _mm512_mul_ps(ta.d23, dw),
        _mm512_cvtepi32_ps(lanes[1]),
        acc[1],
    );
}

/// One Q6_K row against `P` tiles: `[tile][token]`. Each lane starts at `-32 · offset`
/// (`Q6K::dot_with`'s `lane - (offset << 5)`, exact), the unsigned values' sums added on.
// Indexed loops: written with iterators, this measured 4% slower (worse inlining).
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q6_k_row<const P: usize>(row: &[u8], prep: &[TileActs]) -> [[f32; TILE]; P] {
    let mut acc = [[_mm512_setzero_ps(); 2]; P];
    let m4 = _mm512_set1_epi8(0x0f);
    let m2 = _mm512_set1_epi8(0x03);
    // 0 in the low 128 bits of each half, 1 in the high ones.
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
    for (i, wb) in row.chunks_exact(210).enumerate() {
        let h = u16::from_le_bytes([wb[208], wb[209]]);
        let dw = _mm512_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h)))));
        let sc = &wb[192..208];
        // SAFETY: `sc` is 16 readable bytes; the load is unaligned.
        let sc16 = unsafe { _mm256_cvtepi8_epi16(_mm_loadu_si128(sc.as_ptr().cast())) };
        let sc_all = _mm512_broadcast_i64x4(sc16);
        // -32·sc is within ±4,096: an exact i16, and each lane's two products an exact i32.
        let neg32 = _mm512_broadcast_i64x4(_mm256_sub_epi16(
            _mm256_setzero_si256(),
            _mm256_slli_epi16::<5>(sc16),
        ));
        let mut lanes: [[__m512i; 2]; P] = std::array::from_fn(|p| {
            let ta = &prep[i * P + p];
            [
                _mm512_madd_epi16(ta.s0, neg32),
                _mm512_madd_epi16(ta.s1, neg32),
            ]
        });
        for half in 0..2 {
            let l0 = both_halves(wb, 64 * half);
            let l1 = both_halves(wb, 64 * half + 32);
            let h = both_halves(wb, 128 + 32 * half);
            let lows = [
                _mm512_and_si512(l0, m4),
                _mm512_and_si512(l1, m4),
                _mm512_and_si512(_mm512_srli_epi16::<4>(l0), m4),
                _mm512_and_si512(_mm512_srli_epi16::<4>(l1), m4),
            ];
            let highs = [
                _mm512_and_si512(h, m2),
                _mm512_and_si512(_mm512_srli_epi16::<2>(h), m2),
                _mm512_and_si512(_mm512_srli_epi16::<4>(h), m2),
                _mm512_and_si512(_mm512_srli_epi16::<6>(h), m2),
            ];
            for k in 0..4 {
                let q = _mm512_or_si512(lows[k], _mm512_slli_epi16::<4>(highs[k]));
                let e = 128 * half + 32 * k;
                // In each half, the low 128 bits are group e / 16, the high ones the next.
                let g = e / 16;
                // One permute from the scales as i16 (building the vector from bytes took
                // several instructions a chunk).
                let scales = _mm512_permutexvar_epi16(
                    _mm512_add_epi16(groups, _mm512_set1_epi16(g as i16)),
                    sc_all,
                );
                for p in 0..P {
                    let ta = &prep[i * P + p];
                    for hh in 0..2 {
                        let x = _mm512_maddubs_epi16(q, ta.q[hh][e / 32]);
                        lanes[p][hh] = _mm512_dpwssd_epi32(lanes[p][hh], x, scales);
                    }
                }
            }
        }
        for p in 0..P {
            let ta = &prep[i * P + p];
            scale_lanes(&mut acc[p], ta, dw, lanes[p]);
        }
    }
    std::array::from_fn(|p| finish(acc[p], None))
}
