//! AVX2 lane sums of Q2_K and Q3_K (`quant/low_kquants.rs`), as llama.cpp's kernels form them
//! (see `lanes` there). Each lane is an exact `i32`: quants are at most 7 in magnitude,
//! activations at most 127, scales at most 32, so no lane comes near overflow.

use std::arch::x86_64::*;

/// 32 bytes from `b[at..at + 32]`.
#[target_feature(enable = "avx2")]
fn load<T: Copy>(b: &[T], at: usize) -> __m256i {
    let s = &b[at..at + 32 / std::mem::size_of::<T>()];
    // SAFETY: `s` is exactly 32 bytes of plain integers (the slice index above panics
    // otherwise); the load is unaligned.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

#[target_feature(enable = "avx2")]
fn store(v: __m256i) -> [i32; 8] {
    let mut out = [0i32; 8];
    // SAFETY: `out` is 32 writable bytes; the store is unaligned.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), v) };
    out
}

/// Pairwise i16 sums of 32 products (from `maddubs`), each group's 16 multiplied by its
/// scale: the low 128 bits hold group g, the high ones group g + 1; i32 lane `i` ends up
/// with elements `4i..4i+4`.
#[target_feature(enable = "avx2")]
fn scaled(p: __m256i, lo: i16, hi: i16) -> __m256i {
    let scales = _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo));
    _mm256_madd_epi16(p, scales)
}

/// The four 2-bit fields of each byte of `q`, lowest first. A 16-bit shift moves the
/// upper byte's bits into the lower byte's top, which the mask drops.
#[target_feature(enable = "avx2")]
fn two_bit_fields(q: __m256i) -> [__m256i; 4] {
    let m3 = _mm256_set1_epi8(3);
    [
        _mm256_and_si256(q, m3),
        _mm256_and_si256(_mm256_srli_epi16::<2>(q), m3),
        _mm256_and_si256(_mm256_srli_epi16::<4>(q), m3),
        _mm256_and_si256(_mm256_srli_epi16::<6>(q), m3),
    ]
}

/// Q2_K's lanes: `qs` its 64 bytes of 2-bit quants (element `128h + 32j + l` at bits
/// `2j..` of `qs[32h + l]`), `a` the Q8_K quants, `sc` the sixteen 4-bit group scales.
/// Products of `maddubs` are at most 2 · 3 · 127, so it never saturates.
#[target_feature(enable = "avx2")]
pub fn q2_k_lanes(qs: &[u8], a: &[i8; 256], sc: &[u8; 16]) -> [i32; 8] {
    assert!(qs.len() >= 64);
    let mut acc = _mm256_setzero_si256();
    for h in 0..2 {
        for (j, &v) in two_bit_fields(load(qs, 32 * h)).iter().enumerate() {
            let e = 128 * h + 32 * j;
            let p = _mm256_maddubs_epi16(v, load(a, e));
            let g = e / 16;
            let s = scaled(p, i16::from(sc[g]), i16::from(sc[g + 1]));
            acc = _mm256_add_epi32(acc, s);
        }
    }
    store(acc)
}

/// `gguf::q3_k_scales` as `i16`s (group `g` in lane `g`).
#[inline]
#[target_feature(enable = "avx2")]
pub fn q3_k_scales_i16(s: &[u8]) -> __m256i {
    _mm256_cvtepi8_epi16(q3_k_scale_bytes(s))
}

/// `gguf::q3_k_scales` (group `g` in byte `g`), in a few vector instructions.
#[inline]
#[target_feature(enable = "avx2")]
pub fn q3_k_scale_bytes(s: &[u8]) -> __m128i {
    let s = &s[..12];
    let m4 = _mm_set1_epi8(0x0f);
    // SAFETY: `s` is 12 readable bytes (sliced above); the load reads the first 8,
    // unaligned.
    let low8 = unsafe { _mm_loadl_epi64(s.as_ptr().cast()) };
    // Group g < 8: the low nibble of byte g; g >= 8: the high nibble of byte g - 8.
    let low = _mm_unpacklo_epi64(
        _mm_and_si128(low8, m4),
        _mm_and_si128(_mm_srli_epi16::<4>(low8), m4),
    );
    // Group g's top two bits: bits 2 (g / 4).. of byte 8 + g % 4, so the 32-bit lane
    // g / 4 of the broadcast bytes 8..12, shifted by 2 (g / 4).
    let aux = _mm_set1_epi32(i32::from_le_bytes([s[8], s[9], s[10], s[11]]));
    let high = _mm_and_si128(
        _mm_srlv_epi32(aux, _mm_setr_epi32(0, 2, 4, 6)),
        _mm_set1_epi8(3),
    );
    // Each byte is at most 63 before the subtraction: no carry crosses bytes.
    _mm_sub_epi8(
        _mm_or_si128(low, _mm_slli_epi16::<4>(high)),
        _mm_set1_epi8(32),
    )
}

/// Q3_K's lanes of signed values (`q − 4`) for the super-block `wb` (ggml's 110 bytes:
/// 32 bytes of high bits, element `e`'s at bit `e / 32` of `hmask[e % 32]`, then 64
/// bytes of low bits laid out as Q2_K's, then the packed group scales). As llama.cpp,
/// the low bits and the 4 a missing high bit subtracts go through `maddubs` separately
/// (at most 2 · 4 · 127 each, never saturating) and are subtracted in i16.
#[target_feature(enable = "avx2")]
pub fn q3_k_lanes(wb: &[u8], a: &[i8; 256]) -> [i32; 8] {
    assert!(wb.len() >= 108);
    let (hmask, qs) = (&wb[..32], &wb[32..96]);
    let scales = q3_k_scales_i16(&wb[96..108]);
    let four = _mm256_set1_epi8(4);
    let hm = load(hmask, 0);
    // 4 where bit `b` of `hmask[l]` is clear.
    let missing = |b: usize| {
        let bit = _mm256_set1_epi8((1u8 << b) as i8);
        _mm256_andnot_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit), four)
    };
    let mut acc = _mm256_setzero_si256();
    for h in 0..2 {
        // Groups 8h.. (this half's eight) in both 128-bit lanes.
        let half_scales = if h == 0 {
            _mm256_permute2x128_si256::<0x00>(scales, scales)
        } else {
            _mm256_permute2x128_si256::<0x11>(scales, scales)
        };
        for (j, &low) in two_bit_fields(load(qs, 32 * h)).iter().enumerate() {
            let e = 128 * h + 32 * j;
            let x = load(a, e);
            let p = _mm256_sub_epi16(
                _mm256_maddubs_epi16(low, x),
                _mm256_maddubs_epi16(missing(4 * h + j), x),
            );
            // Group 2j of the half (its i16 at bytes 4j, 4j + 1) in the low lane,
            // 2j + 1 in the high one.
            let (lo, hi) = (4 * j as i8, 4 * j as i8 + 2);
            let pick: [i8; 32] =
                std::array::from_fn(|b| (if b < 16 { lo } else { hi }) + (b % 2) as i8);
            // SAFETY: `pick` is 32 readable bytes; the load is unaligned.
            let pick = unsafe { _mm256_loadu_si256(pick.as_ptr().cast()) };
            let s = _mm256_madd_epi16(p, _mm256_shuffle_epi8(half_scales, pick));
            acc = _mm256_add_epi32(acc, s);
        }
    }
    store(acc)
}
