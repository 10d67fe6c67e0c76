//! AVX2 integer lanes of Q4_K, Q5_K and Q6_K (`quant/kquants.rs`) and the AVX2 tile of
//! Q5_1 (`quant/q5.rs`), laid out as llama.cpp's kernels form them (see each
//! format's `dot_scalar`). Every lane is an exact `i32` (bounded far below overflow), so the
//! result is the portable code's.

use std::arch::x86_64::*;

use super::x86::prefetch_ahead;
use crate::blocks::{f16_at, BlockQ8K, BlockQ8_1, TILE};

/// 32 bytes from `b[at..at + 32]`.
#[target_feature(enable = "avx2")]
fn load<T: Copy>(b: &[T], at: usize) -> __m256i {
    let s = &b[at..at + 32 / std::mem::size_of::<T>()];
    // SAFETY: `s` is exactly 32 bytes of plain integers (the slice index above panics
    // otherwise); the load is unaligned.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// One Q4_K weight row against one activation row: `Q4K::dot_with`'s float chain (two
/// fused multiply-adds per super-block, the same operands in the same order) on the exact
/// sums of [`q4_k_lanes_n`], so the bits of `Q4K::dot_scalar`. Kept whole in one function
/// compiled for AVX2: a decode step spends most of its time here, and a call per
/// super-block across the target-feature boundary would cost more than its lanes.
#[target_feature(enable = "avx2,fma")]
pub fn q4_k_dot(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let mut acc = 0f32;
    for (wb, ab) in w.chunks_exact(144).zip(a) {
        let d = ab.d * f16_at(wb, 0);
        let dmin = -ab.d * f16_at(wb, 2);
        let (sc, m) = k4_scales_mins(&wb[4..16]);
        // SAFETY: `bsums` is 16 readable i16 (32 bytes), `m` 8 bytes; unaligned loads.
        let min_sum = unsafe {
            let b = _mm256_loadu_si256(ab.bsums.as_ptr().cast());
            // Each sub-block's 32 activations: pairs of `bsums`, within ±4,064.
            let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(b), _mm256_extracti128_si256::<1>(b));
            let mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(m.as_ptr().cast()));
            let v = _mm_madd_epi16(pairs, mins);
            let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b01_00_11_10>(v));
            let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b10_11_00_01>(v));
            _mm_cvtsi128_si32(v)
        };
        let [lanes] = q4_k_lanes_n(&wb[16..144], [&ab.qs], &sc);
        let sum: i32 = lanes.iter().sum();
        acc = d.mul_add(sum as f32, acc);
        acc = dmin.mul_add(min_sum as f32, acc);
    }
    acc
}

/// The eight 6-bit scales and mins of a Q4_K super-block (`gguf::k4_scale_min`'s) from its
/// 12 packed bytes, four at a time: bytes 0..4 hold scales 0..4 in their low six bits and
/// the top two bits of scales 4..8, bytes 4..8 the same for the mins, bytes 8..12 the low
/// four bits of scales 4..8 (low nibbles) and mins 4..8 (high nibbles).
#[inline]
pub(crate) fn k4_scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let word = |at: usize| u32::from_le_bytes([s[at], s[at + 1], s[at + 2], s[at + 3]]);
    let (a, b, c) = (word(0), word(4), word(8));
    let sc_hi = (c & 0x0f0f_0f0f) | (((a >> 6) & 0x0303_0303) << 4);
    let m_hi = ((c >> 4) & 0x0f0f_0f0f) | (((b >> 6) & 0x0303_0303) << 4);
    let join = |lo: u32, hi: u32| (u64::from(lo) | (u64::from(hi) << 32)).to_le_bytes();
    (join(a & 0x3f3f_3f3f, sc_hi), join(b & 0x3f3f_3f3f, m_hi))
}

/// The lanes of `Σ_j sc[j] · Σ_l q[32j + l] · a[32j + l]` (see `Q4K::dot_scalar`) for one
/// Q4_K super-block and each of `N` activation rows: `qs` its 128 bytes of nibbles
/// (sub-block 2c in the low nibbles of bytes 32c.., 2c + 1 in the high ones), `a` the Q8_K
/// quants. Products are at most 15 · 127, so the pairwise i16 sums of `maddubs` never
/// saturate. The nibbles are unpacked and the scale vectors built once for all rows (each
/// row's lanes are exact, so the same as alone).
#[inline]
#[target_feature(enable = "avx2")]
pub fn q4_k_lanes_n<const N: usize>(qs: &[u8], a: [&[i8; 256]; N], sc: &[u8; 8]) -> [[i32; 8]; N] {
    assert!(qs.len() >= 128);
    prefetch_ahead(&qs[0]);
    let mask = _mm256_set1_epi8(0x0f);
    let mut acc = [_mm256_setzero_si256(); N];
    for c in 0..4 {
        let q = load(qs, 32 * c);
        let lo = _mm256_and_si256(q, mask);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask);
        let sc_lo = _mm256_set1_epi16(i16::from(sc[2 * c]));
        let sc_hi = _mm256_set1_epi16(i16::from(sc[2 * c + 1]));
        for (acc, x) in acc.iter_mut().zip(a) {
            let s_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load(x, 64 * c)), sc_lo);
            let s_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load(x, 64 * c + 32)), sc_hi);
            *acc = _mm256_add_epi32(*acc, _mm256_add_epi32(s_lo, s_hi));
        }
    }
    acc.map(|v| {
        let mut lanes = [0i32; 8];
        // SAFETY: `lanes` is 32 writable bytes; the store is unaligned.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), v) };
        lanes
    })
}

/// As [`q4_k_lanes_n`] for one row of Q5_K: the fifth bit of sub-block `j`'s element `l` is bit `j` of
/// `qh[l]`. Products are at most 31 · 127, so `maddubs` never saturates.
#[target_feature(enable = "avx2")]
pub fn q5_k_lanes(qh: &[u8], qs: &[u8], a: &[i8; 256], sc: &[u8; 8]) -> [i32; 8] {
    assert!(qh.len() >= 32 && qs.len() >= 128);
    // The 176-byte block from its high bits on: four lines.
    prefetch_ahead(&qh[0]);
    prefetch_ahead(&qs[64]);
    let mask = _mm256_set1_epi8(0x0f);
    let five = _mm256_set1_epi8(0x10);
    let h = load(qh, 0);
    // 0x10 where bit `j` of `qh[l]` is set.
    let high = |j: usize| {
        let bit = _mm256_set1_epi8((1u8 << j) as i8);
        _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), five)
    };
    let mut acc = _mm256_setzero_si256();
    for c in 0..4 {
        let q = load(qs, 32 * c);
        let lo = _mm256_or_si256(_mm256_and_si256(q, mask), high(2 * c));
        let hi = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask),
            high(2 * c + 1),
        );
        let p_lo = _mm256_maddubs_epi16(lo, load(a, 64 * c));
        let p_hi = _mm256_maddubs_epi16(hi, load(a, 64 * c + 32));
        let s_lo = _mm256_madd_epi16(p_lo, _mm256_set1_epi16(i16::from(sc[2 * c])));
        let s_hi = _mm256_madd_epi16(p_hi, _mm256_set1_epi16(i16::from(sc[2 * c + 1])));
        acc = _mm256_add_epi32(acc, _mm256_add_epi32(s_lo, s_hi));
    }
    let mut lanes = [0i32; 8];
    // SAFETY: `lanes` is 32 writable bytes; the store is unaligned.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), acc) };
    lanes
}

/// One Q6_K weight row against one activation row, `Q6K::dot_with`'s float chain (as
/// [`q4_k_dot`] for Q4_K): each lane's offset `Σ bsums · sc` over its two groups is one
/// `madd` of the same exact `i32`s, subtracted shifted by 5 from the lanes, their exact sum
/// then one fused multiply-add per super-block: the bits of `Q6K::dot_scalar`.
#[target_feature(enable = "avx2,fma")]
pub fn q6_k_dot(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let mut acc = 0f32;
    for (wb, ab) in w.chunks_exact(210).zip(a) {
        let mut sc = [0i8; 16];
        for (s, &b) in sc.iter_mut().zip(&wb[192..208]) {
            *s = b as i8;
        }
        let d = ab.d * f16_at(wb, 208);
        let [lanes] = q6_k_lanes_n(&wb[..128], &wb[128..192], [&ab.qs], &sc);
        // SAFETY: `lanes` is 32 readable bytes, `bsums` 16 i16 (32 bytes), `sc` 16 bytes;
        // the loads are unaligned.
        let (lanes, bsums, scales) = unsafe {
            (
                _mm256_loadu_si256(lanes.as_ptr().cast()),
                _mm256_loadu_si256(ab.bsums.as_ptr().cast()),
                _mm256_cvtepi8_epi16(_mm_loadu_si128(sc.as_ptr().cast())),
            )
        };
        // |bsums| ≤ 16 · 128 and |sc| ≤ 128: each product and pair sum is an exact i32.
        let offset = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums, scales));
        let v = _mm256_sub_epi32(lanes, offset);
        let v = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b01_00_11_10>(v));
        let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b10_11_00_01>(v));
        acc = d.mul_add(_mm_cvtsi128_si32(v) as f32, acc);
    }
    acc
}

/// The eight lane sums of one Q6_K super-block, for each of `N` activation rows (unpacked
/// once), as llama.cpp's AVX2 kernel forms them
/// (see `Q6K::dot_scalar`), with the 6-bit values taken unsigned (0..63; the caller
/// subtracts the offset of 32): `ql` 128 bytes of low nibbles, `qh` 64 bytes of high bit
/// pairs, groups of 16. Products are at most 63 · 127, so `maddubs` never saturates.
#[inline]
#[target_feature(enable = "avx2")]
pub fn q6_k_lanes_n<const N: usize>(
    ql: &[u8],
    qh: &[u8],
    a: [&[i8; 256]; N],
    sc: &[i8; 16],
) -> [[i32; 8]; N] {
    assert!(ql.len() >= 128 && qh.len() >= 64);
    // The 210-byte block: four lines from its low nibbles on.
    prefetch_ahead(&ql[0]);
    prefetch_ahead(&qh[0]);
    let m4 = _mm256_set1_epi8(0x0f);
    let m2 = _mm256_set1_epi8(0x03);
    let mut acc = [_mm256_setzero_si256(); N];
    for half in 0..2 {
        let l0 = load(ql, 64 * half);
        let l1 = load(ql, 64 * half + 32);
        let h = load(qh, 32 * half);
        // Element 128·half + 32·k + l: low nibble of ql[l] (k = 0), ql[l + 32] (1),
        // high nibble of ql[l] (2), ql[l + 32] (3); high bits (qh[l] >> 2k) & 3.
        let lows = [
            _mm256_and_si256(l0, m4),
            _mm256_and_si256(l1, m4),
            _mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4),
            _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4),
        ];
        let highs = [
            _mm256_and_si256(h, m2),
            _mm256_and_si256(_mm256_srli_epi16::<2>(h), m2),
            _mm256_and_si256(_mm256_srli_epi16::<4>(h), m2),
            _mm256_and_si256(_mm256_srli_epi16::<6>(h), m2),
        ];
        for k in 0..4 {
            let q = _mm256_or_si256(lows[k], _mm256_slli_epi16::<4>(highs[k]));
            let e = 128 * half + 32 * k;
            // The low 128 bits hold group e / 16, the high ones the next.
            let g = e / 16;
            let scales = _mm256_set_m128i(
                _mm_set1_epi16(i16::from(sc[g + 1])),
                _mm_set1_epi16(i16::from(sc[g])),
            );
            for (acc, x) in acc.iter_mut().zip(a) {
                let p = _mm256_maddubs_epi16(q, load(x, e));
                *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(p, scales));
            }
        }
    }
    acc.map(|v| {
        let mut lanes = [0i32; 8];
        // SAFETY: `lanes` is 32 writable bytes; the store is unaligned.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), v) };
        lanes
    })
}

/// One Q5_1 weight row against up to [`TILE`] activation rows, `out[t]`: per block the
/// values are unpacked once ([`five_bit_madd`]), then each token's eight exact lane sums go
/// into its own eight f32 lanes as the portable definition (`Q5_1::dot_scalar`: llama.cpp's
/// order) does, so its bits.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn q5_1_rows(w: &[u8], acts: &[&[BlockQ8_1]], out: &mut [f32]) {
    // One instance per token count: a decode step has one token, and computing a whole
    // tile's lane sums for it was three quarters wasted work.
    match acts.len() {
        0 => {}
        1 => q5_1_rows_n::<1>(w, acts, out),
        2 => q5_1_rows_n::<2>(w, acts, out),
        3 => q5_1_rows_n::<3>(w, acts, out),
        _ => q5_1_rows_n::<{ TILE }>(w, acts, out),
    }
}

/// [`q5_1_rows`] for `N` tokens (`acts` holds at least `N`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q5_1_rows_n<const N: usize>(w: &[u8], acts: &[&[BlockQ8_1]], out: &mut [f32]) {
    let mut acc = [_mm256_setzero_ps(); N];
    let mut summs = [0f32; N];
    for (i, wb) in w.chunks_exact(24).enumerate() {
        // A plain loop: `array::from_fn`'s closure stayed a call per block (closures do
        // not inherit this function's target features).
        let mut a: [&[i8; 32]; N] = [&acts[0][i].qs; N];
        for (t, a) in a.iter_mut().enumerate() {
            *a = &acts[t][i].qs;
        }
        let lanes = five_bit_madd(&wb[4..8], &wb[8..24], a);
        let scales = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes([
            wb[0], wb[1], wb[2], wb[3],
        ])));
        let d = _mm_cvtss_f32(scales);
        let m = _mm_cvtss_f32(_mm_movehdup_ps(scales));
        for t in 0..N {
            let ab = &acts[t][i];
            summs[t] += m * ab.s;
            let dd = _mm256_set1_ps(d * ab.d);
            acc[t] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(lanes[t]), acc[t]);
        }
    }
    for t in 0..N {
        out[t] = hsum_f32(acc[t]) + summs[t];
    }
}

/// ggml's `hsum_float_8`.
#[inline]
#[target_feature(enable = "avx2")]
fn hsum_f32(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_extractf128_ps::<1>(v), _mm256_castps256_ps128(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// `Σ q·a` over each run of four elements (eight exact `i32` lanes per token, lane `l`
/// for elements `4l..4l + 4`, as ggml's `mul_sum_i8_pairs`) for one Q5_1 block against `N`
/// Q8 blocks: `qh` the 32 fifth bits, `qs` 16 bytes of nibbles (elements 0..16 low, 16..32
/// high). `q` is at most 31, so `maddubs` never saturates.
#[inline]
#[target_feature(enable = "avx2")]
fn five_bit_madd<const N: usize>(qh: &[u8], qs: &[u8], a: [&[i8; 32]; N]) -> [__m256i; N] {
    assert!(qh.len() >= 4 && qs.len() >= 16);
    let mask = _mm_set1_epi8(0x0f);
    // SAFETY: `qs` holds at least 16 bytes (asserted); the load is unaligned.
    let q = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    let nibbles = _mm256_set_m128i(
        _mm_and_si128(_mm_srli_epi16::<4>(q), mask),
        _mm_and_si128(q, mask),
    );
    // Byte j of the bit mask tests bit j of `qh`: broadcast byte j / 8, mask bit j % 8.
    let bits = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    let values = _mm256_or_si256(nibbles, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    let ones = _mm256_set1_epi16(1);
    a.map(|x| _mm256_madd_epi16(_mm256_maddubs_epi16(values, load(&x[..], 0)), ones))
}

#[cfg(test)]
mod tests {
    /// The word-wise unpacking gives `gguf::k4_scale_min`'s scales and mins for every byte
    /// value in every position.
    #[test]
    fn k4_scales_mins_equal_the_definition() {
        let mut s = [0u8; 12];
        for pos in 0..12 {
            for v in 0..=255u8 {
                s[pos] = v;
                s[(pos + 5) % 12] = v.wrapping_mul(37);
                let (sc, m) = super::k4_scales_mins(&s);
                for j in 0..8 {
                    assert_eq!((sc[j], m[j]), gguf::k4_scale_min(j, &s), "{s:?} {j}");
                }
            }
        }
    }
}
