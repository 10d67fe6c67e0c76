//! The 256- and 512-bit builds of the attention arithmetic (`super::attend_rows_with`
//! compiled with those instruction sets) and the vector steps they do it with.

use std::arch::x86_64::*;

/// `dst[i] = f32(src[i])` over whole groups of 8 (exact, as the scalar conversion); returns how
/// many were done.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn widen_f16(src: &[half::f16], dst: &mut [f32]) -> usize {
    let mut done = 0;
    for (d, s) in dst.chunks_exact_mut(8).zip(src.chunks_exact(8)) {
        // SAFETY: `s` is 8 f16 (16 bytes) and `d` 8 f32; unaligned loads and stores are
        // allowed.
        unsafe {
            _mm256_storeu_ps(
                d.as_mut_ptr(),
                _mm256_cvtph_ps(_mm_loadu_si128(s.as_ptr() as *const __m128i)),
            )
        };
        done += 8;
    }
    done
}

/// The 256-bit build: the definition's steps, the vector `exp`.
struct Narrow;

impl super::Build for Narrow {
    #[inline(always)]
    fn exp(xs: &mut [f32]) {
        super::super::libm_expf::expf_in_place(xs);
    }
}

/// The 512-bit build: 16 keys' lane trees at once ([`reduce_16x16`]), the vector `exp`.
/// Used only inside [`attend_rows_512`], whose caller has checked the CPU.
struct Wide;

impl super::Build for Wide {
    #[inline(always)]
    fn row_block<const HD: usize>(
        b: super::RowBlock<'_>,
        max: &mut [f32],
        sums: &mut [[f32; 16]],
        acc: &mut [f32],
    ) {
        // SAFETY: `Wide` is only instantiated in `attend_rows_512`, which requires AVX-512 F,
        // BW, DQ and VL with AVX2, FMA and F16C.
        unsafe {
            match HD {
                64 => wide_row_block::<4>(b, max, sums, acc),
                128 => wide_row_block::<8>(b, max, sums, acc),
                256 => wide_row_block::<16>(b, max, sums, acc),
                _ => super::row_block_with::<Self>(b, max, sums, acc),
            }
        }
    }

    #[inline(always)]
    fn exp(xs: &mut [f32]) {
        super::super::libm_expf::expf_in_place(xs);
    }
}

/// [`super::row_block_with`] for heads of `16 * C` in 512-bit registers, the same operations
/// in the same order: the scores of up to four heads at once (each head's chains over the
/// elements for 16 keys per register, the keys' rows loaded once for all four), the block's
/// maximum over the valid lanes (NaN excluded, as the definition's `>` comparisons exclude
/// it; only a zero maximum's sign can differ, which changes no `exp` argument but a zero
/// one's sign), and the V updates of up to `16 / C` heads interleaved with their
/// accumulators in registers (independent chains; each head's keys in order).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
fn wide_row_block<const C: usize>(
    b: super::RowBlock<'_>,
    max: &mut [f32],
    sums: &mut [[f32; 16]],
    acc: &mut [f32],
) {
    const B: usize = super::KEY_BLOCK;
    const G: usize = B / 16;
    let hd = 16 * C;
    let heads = max.len();
    let super::RowBlock {
        q,
        kt,
        vf,
        lo,
        hi,
        scale,
        ..
    } = b;
    assert!(
        b.hd == hd
            && q.len() >= heads * hd
            && acc.len() >= heads * hd
            && sums.len() == heads
            && kt.len() >= B * hd
            && vf.len() >= B * hd
            && lo < hi
            && hi <= B
    );
    let below = |n: usize| if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
    let span = below(hi) & !below(lo);
    let masks: [u16; G] = std::array::from_fn(|g| (span >> (16 * g)) as u16);
    let (g_lo, g_hi) = (lo / 16, hi.div_ceil(16));
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let scale_v = _mm512_set1_ps(scale);
    let per_v_pass = 4;
    for h0 in (0..heads).step_by(4) {
        let n = (heads - h0).min(4);
        let qs = &q[h0 * hd..(h0 + n) * hd];
        let dots = match n {
            4 => wide_scores::<4>(qs, kt, hd),
            3 => pad(wide_scores::<3>(qs, kt, hd)),
            2 => pad(wide_scores::<2>(qs, kt, hd)),
            _ => pad(wide_scores::<1>(qs, kt, hd)),
        };
        let mut weights = [[0f32; B]; 4];
        let mut live = [false; 4];
        for i in 0..n {
            let h = h0 + i;
            let s: [__m512; G] = std::array::from_fn(|g| {
                _mm512_mask_mov_ps(ninf, masks[g], _mm512_mul_ps(dots[i][g], scale_v))
            });
            let m = (0..G).fold(f32::NEG_INFINITY, |m, g| {
                let keep = masks[g] & _mm512_cmp_ps_mask::<_CMP_ORD_Q>(s[g], s[g]);
                let x = _mm512_mask_reduce_max_ps(keep, s[g]);
                if x > m {
                    x
                } else {
                    m
                }
            });
            let ah = &mut acc[h * hd..(h + 1) * hd];
            if m > max[h] {
                if max[h] != f32::NEG_INFINITY {
                    let a = _mm512_set1_ps((max[h] - m).exp());
                    for x in ah.chunks_exact_mut(16) {
                        // SAFETY: `x` is 16 f32; unaligned loads and stores are allowed.
                        unsafe {
                            _mm512_storeu_ps(
                                x.as_mut_ptr(),
                                _mm512_mul_ps(_mm512_loadu_ps(x.as_ptr()), a),
                            )
                        };
                    }
                    // SAFETY: as above, the 16 sum lanes.
                    unsafe {
                        let sv = _mm512_mul_ps(_mm512_loadu_ps(sums[h].as_ptr()), a);
                        _mm512_storeu_ps(sums[h].as_mut_ptr(), sv);
                    }
                }
                max[h] = m;
            }
            live[i] = max[h] != f32::NEG_INFINITY;
            if !live[i] {
                continue;
            }
            let mv = _mm512_set1_ps(max[h]);
            let w = &mut weights[i];
            // Keys outside the row's span get the argument 0 (no special input for the
            // vector `exp`) and are cleared after; groups with no key of the span are left
            // out.
            // SAFETY: `w` is `B` f32 and `sums[h]` 16: loads and stores of 16 at multiples of
            // 16 below `B`, unaligned allowed.
            unsafe {
                for g in g_lo..g_hi {
                    let arg = _mm512_maskz_sub_ps(masks[g], s[g], mv);
                    _mm512_storeu_ps(w.as_mut_ptr().add(16 * g), arg);
                }
                super::super::libm_expf::expf_in_place(&mut w[16 * g_lo..16 * g_hi]);
                let mut sv = _mm512_loadu_ps(sums[h].as_ptr());
                for (g, &mask) in masks.iter().enumerate() {
                    let wg = if (g_lo..g_hi).contains(&g) {
                        _mm512_maskz_mov_ps(mask, _mm512_loadu_ps(w.as_ptr().add(16 * g)))
                    } else {
                        _mm512_setzero_ps()
                    };
                    _mm512_storeu_ps(w.as_mut_ptr().add(16 * g), wg);
                    sv = _mm512_add_ps(sv, wg);
                }
                _mm512_storeu_ps(sums[h].as_mut_ptr(), sv);
            }
        }
        for v0 in (0..n).step_by(per_v_pass) {
            let m = (n - v0).min(per_v_pass);
            let pass = &mut acc[(h0 + v0) * hd..(h0 + v0 + m) * hd];
            let ws = &weights[v0..v0 + m];
            if live[v0..v0 + m].iter().all(|&l| l) {
                match m {
                    4 => wide_v_updates::<C, 4>(ws, vf, lo, hi, pass),
                    3 => wide_v_updates::<C, 3>(ws, vf, lo, hi, pass),
                    2 => wide_v_updates::<C, 2>(ws, vf, lo, hi, pass),
                    _ => wide_v_updates::<C, 1>(ws, vf, lo, hi, pass),
                }
            } else {
                for i in (0..m).filter(|&i| live[v0 + i]) {
                    let one = &mut pass[i * hd..(i + 1) * hd];
                    wide_v_updates::<C, 1>(&ws[i..i + 1], vf, lo, hi, one);
                }
            }
        }
    }
}

/// Four heads' dots from fewer (the rest zero, unused).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
fn pad<const H: usize>(d: [[__m512; 2]; H]) -> [[__m512; 2]; 4] {
    std::array::from_fn(|h| {
        if h < H {
            d[h]
        } else {
            [_mm512_setzero_ps(); 2]
        }
    })
}

/// `dot(q_h, k_j)` of the definition for `H` heads (`hd` each, a multiple of 4, consecutive
/// in `q`) and the block's 32 keys (`kt`: keys in lanes), 16 keys per register: per head and
/// group of 16 keys the four chains over the elements `d ≡ c (mod 4)`, then
/// `(p0 + p2) + (p1 + p3)`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
fn wide_scores<const H: usize>(q: &[f32], kt: &[f32], hd: usize) -> [[__m512; 2]; H] {
    const B: usize = super::KEY_BLOCK;
    const _: () = assert!(B == 32);
    assert!(q.len() >= H * hd && kt.len() >= B * hd && hd.is_multiple_of(4));
    let mut out = [[_mm512_setzero_ps(); 2]; H];
    let heads: [&[f32]; H] = std::array::from_fn(|h| &q[h * hd..(h + 1) * hd]);
    for g in 0..2 {
        let mut p = [[_mm512_setzero_ps(); 4]; H];
        // Each step's four elements of every head and four K rows sliced once: indexing
        // `q` element by element left a bounds check beside every multiply-add and one
        // accumulator spilled to the stack.
        for (d4, k4) in kt[..hd * B].chunks_exact(4 * B).enumerate() {
            let qd: [&[f32; 4]; H] = std::array::from_fn(|h| {
                heads[h][4 * d4..4 * d4 + 4]
                    .try_into()
                    .expect("four elements")
            });
            for c in 0..4 {
                let row = &k4[c * B + 16 * g..c * B + 16 * g + 16];
                // SAFETY: `row` is 16 f32 (sliced above); the load is unaligned.
                let k = unsafe { _mm512_loadu_ps(row.as_ptr()) };
                for (p, qd) in p.iter_mut().zip(&qd) {
                    p[c] = _mm512_fmadd_ps(_mm512_set1_ps(qd[c]), k, p[c]);
                }
            }
        }
        for (o, p) in out.iter_mut().zip(&p) {
            o[g] = _mm512_add_ps(_mm512_add_ps(p[0], p[2]), _mm512_add_ps(p[1], p[3]));
        }
    }
    out
}

/// [`super::KvElem::widen_transposed`] for f16 rows of a multiple of 16: 16 keys × 16
/// elements at a time converted and transposed in registers.
///
/// # Safety
/// The CPU must support AVX-512 F with F16C; `hd` must be a multiple of 16.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
pub unsafe fn widen_transposed_f16_512(
    rows: &[&[half::f16]],
    hd: usize,
    off: usize,
    kt: &mut [f32],
) {
    assert!(rows.iter().all(|r| r.len() >= hd));
    transposed_16s(rows.len(), hd, off, kt, |key, d0| {
        // SAFETY: 16 f16 at d0 lie within the row (asserted length); unaligned loads are
        // allowed.
        _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(rows[key].as_ptr().add(d0) as *const __m256i) })
    });
}

/// [`super::KvElem::widen_transposed`] for `keys` f32 rows of `hd` (a multiple of 16) laid
/// end to end in `flat` (a block cache's, dequantized), as [`widen_transposed_f16_512`].
///
/// # Safety
/// The CPU must support AVX-512 F; `hd` must be a multiple of 16.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
pub unsafe fn widen_transposed_f32_512(
    flat: &[f32],
    keys: usize,
    hd: usize,
    off: usize,
    kt: &mut [f32],
) {
    assert!(flat.len() >= keys * hd);
    transposed_16s(keys, hd, off, kt, |key, d0| {
        // SAFETY: 16 f32 at `key * hd + d0` lie within `flat` (asserted length, `d0 + 16 <=
        // hd`); unaligned loads are allowed.
        unsafe { _mm512_loadu_ps(flat.as_ptr().add(key * hd + d0)) }
    });
}

/// `kt[d * KEY_BLOCK + off + i] = load(i, d0)[d - d0]` for `keys` keys and `d < hd`, 16
/// keys × 16 elements at a time through a register transposition; `load(i, d0)` is key
/// `i`'s elements `d0..d0 + 16`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
fn transposed_16s(
    keys: usize,
    hd: usize,
    off: usize,
    kt: &mut [f32],
    load: impl Fn(usize, usize) -> __m512,
) {
    const B: usize = super::KEY_BLOCK;
    assert!(hd.is_multiple_of(16) && off + keys <= B && kt.len() >= hd * B);
    for g in 0..keys.div_ceil(16) {
        let at = off + 16 * g;
        let n = (keys - 16 * g).min(16);
        for d0 in (0..hd).step_by(16) {
            let mut x = [_mm512_setzero_ps(); 16];
            for (i, x) in x.iter_mut().enumerate().take(n) {
                *x = load(16 * g + i, d0);
            }
            let t = transpose_16x16(x);
            let mask = if n >= 16 { u16::MAX } else { (1u16 << n) - 1 };
            for (i, t) in t.iter().enumerate() {
                let row = &mut kt[(d0 + i) * B..(d0 + i + 1) * B];
                // SAFETY: the masked store writes lanes `at..at + n` of the 32-entry row,
                // `at + n <= off + keys <= B` (asserted).
                unsafe { _mm512_mask_storeu_ps(row.as_mut_ptr().add(at), mask, *t) };
            }
        }
    }
}

/// `dst` = the values of Q4_0 blocks (as `kv::KvBlock::dequantize`: each `d · (q − 8)`, one
/// exact product) for whole blocks; returns how many values were done.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn widen_q4_0(src: &[kv::Q4Block], dst: &mut [f32]) -> usize {
    let mut done = 0;
    let (low, eight) = (_mm_set1_epi8(0x0f), _mm256_set1_epi32(8));
    for (d, b) in dst.chunks_exact_mut(32).zip(src) {
        let scale = _mm256_set1_ps(b.d.to_f32());
        // SAFETY: `qs` is 16 readable bytes; the load is unaligned.
        let q = unsafe { _mm_loadu_si128(b.qs.as_ptr() as *const __m128i) };
        // Values 0..16 are the low nibbles, 16..32 the high ones.
        let nibbles = [
            _mm_and_si128(q, low),
            _mm_and_si128(_mm_srli_epi16::<4>(q), low),
        ];
        for (k, bytes) in nibbles.into_iter().enumerate() {
            for (h, eight_bytes) in [bytes, _mm_srli_si128::<8>(bytes)].into_iter().enumerate() {
                let i = _mm256_sub_epi32(_mm256_cvtepu8_epi32(eight_bytes), eight);
                let out = &mut d[16 * k + 8 * h..16 * k + 8 * h + 8];
                // SAFETY: `out` is 8 writable f32; the store is unaligned.
                unsafe {
                    _mm256_storeu_ps(
                        out.as_mut_ptr(),
                        _mm256_mul_ps(scale, _mm256_cvtepi32_ps(i)),
                    )
                };
            }
        }
        done += 32;
    }
    done
}

/// `dst` = the values of Q8_0 blocks (each `d · q`, one exact product) for whole blocks;
/// returns how many values were done.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn widen_q8_0(src: &[kv::Q8Block], dst: &mut [f32]) -> usize {
    let mut done = 0;
    for (d, b) in dst.chunks_exact_mut(32).zip(src) {
        let scale = _mm256_set1_ps(b.d.to_f32());
        for (k, out) in d.chunks_exact_mut(8).enumerate() {
            // SAFETY: `qs[8k..8k + 8]` is 8 readable bytes, `out` 8 writable f32; unaligned.
            unsafe {
                let q = _mm_loadl_epi64(b.qs[8 * k..].as_ptr() as *const __m128i);
                let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(scale, x));
            }
        }
        done += 32;
    }
    done
}

/// [`super::KvElem::widen_transposed`] for f16 rows of a multiple of 8 on 256-bit lanes: 8
/// keys × 8 elements at a time converted and transposed in registers; a last group of fewer
/// than 8 keys one value at a time (the same exact conversion).
///
/// # Safety
/// The CPU must support AVX2 and F16C; `hd` must be a multiple of 8.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn widen_transposed_f16_256(
    rows: &[&[half::f16]],
    hd: usize,
    off: usize,
    kt: &mut [f32],
) {
    const B: usize = super::KEY_BLOCK;
    assert!(hd.is_multiple_of(8) && off + rows.len() <= B && kt.len() >= hd * B);
    assert!(rows.iter().all(|r| r.len() >= hd));
    let whole = rows.len() / 8 * 8;
    for (g, keys) in rows[..whole].chunks_exact(8).enumerate() {
        let at = off + 8 * g;
        for d0 in (0..hd).step_by(8) {
            // SAFETY: 8 f16 at d0 lie within each row (asserted length); unaligned loads
            // are allowed.
            let x: [__m256; 8] = std::array::from_fn(|i| unsafe {
                _mm256_cvtph_ps(_mm_loadu_si128(keys[i].as_ptr().add(d0) as *const __m128i))
            });
            let t = transpose_8x8(x);
            for (i, t) in t.iter().enumerate() {
                let row = &mut kt[(d0 + i) * B + at..(d0 + i) * B + at + 8];
                // SAFETY: `row` is 8 writable f32; unaligned stores are allowed.
                unsafe { _mm256_storeu_ps(row.as_mut_ptr(), *t) };
            }
        }
    }
    for (i, r) in rows.iter().enumerate().skip(whole) {
        for (d, x) in r[..hd].iter().enumerate() {
            kt[d * B + off + i] = x.to_f32();
        }
    }
}

/// `out[c][r] = x[r][c]` for 8 × 8: pairs interleaved, then quads, then 128-bit halves.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn transpose_8x8(x: [__m256; 8]) -> [__m256; 8] {
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (a, b) = (x[i / 2 * 2], x[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    // u[4q + k]: from t[4q + (k / 2)] and t[4q + 2 + (k / 2)], low (k even) or high pairs.
    let u: [__m256; 8] = std::array::from_fn(|i| {
        let (q, k) = (i / 4, i % 4);
        let (a, b) = (t[4 * q + k / 2], t[4 * q + 2 + k / 2]);
        if k % 2 == 0 {
            _mm256_shuffle_ps::<0x44>(a, b)
        } else {
            _mm256_shuffle_ps::<0xEE>(a, b)
        }
    });
    std::array::from_fn(|i| {
        let (a, b) = (u[i % 4], u[4 + i % 4]);
        if i < 4 {
            _mm256_permute2f128_ps::<0x20>(a, b)
        } else {
            _mm256_permute2f128_ps::<0x31>(a, b)
        }
    })
}

/// `out[c][r] = x[r][c]`: four butterfly stages of two-register permutes, stage `BIT`
/// exchanging the elements whose row and column differ in that bit.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
fn transpose_16x16(x: [__m512; 16]) -> [__m512; 16] {
    butterfly::<1>(butterfly::<2>(butterfly::<4>(butterfly::<8>(x))))
}

#[inline(always)]
fn butterfly<const BIT: usize>(mut x: [__m512; 16]) -> [__m512; 16] {
    // Element c of the row with BIT clear: its own if c has BIT clear, else the partner
    // row's c ^ BIT (index 16 + ... picks the second register); the partner row mirrors it.
    let lo_idx: [i32; 16] = std::array::from_fn(|c| {
        if c & BIT == 0 {
            c as i32
        } else {
            16 + (c ^ BIT) as i32
        }
    });
    let hi_idx: [i32; 16] = std::array::from_fn(|c| {
        if c & BIT != 0 {
            16 + c as i32
        } else {
            (c ^ BIT) as i32
        }
    });
    // SAFETY: the caller (`transpose_16x16`) runs with AVX-512 F; both arrays are 16 i32,
    // unaligned loads allowed.
    unsafe {
        let lo = _mm512_loadu_si512(lo_idx.as_ptr() as *const __m512i);
        let hi = _mm512_loadu_si512(hi_idx.as_ptr() as *const __m512i);
        for r in 0..16 {
            if r & BIT == 0 {
                let (a, b) = (x[r], x[r | BIT]);
                x[r] = _mm512_permutex2var_ps(a, lo, b);
                x[r | BIT] = _mm512_permutex2var_ps(a, hi, b);
            }
        }
    }
    x
}

/// `acc_i = fma(w_i[j], v_j, acc_i)` for keys `lo..hi` in order, for `H` heads (`16 * C`
/// elements each, consecutive in `acc`), [`V_CHUNK`] registers of each head's accumulator
/// at a time kept in registers over the block's keys: every element's chain still takes the
/// keys in order, and each V load feeds all `H` heads. With a 256-wide head, one head's
/// whole accumulator in registers left one load per multiply-add, from L2 (a block's K and V
/// are 64 KiB): Gemma 3 at 16,384 tokens spent 30% of its prefill here.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
fn wide_v_updates<const C: usize, const H: usize>(
    weights: &[[f32; super::KEY_BLOCK]],
    vf: &[f32],
    lo: usize,
    hi: usize,
    acc: &mut [f32],
) {
    const { assert!(C.is_multiple_of(V_CHUNK)) };
    let hd = 16 * C;
    assert!(weights.len() >= H && acc.len() >= H * hd && vf.len() >= hi * hd);
    for c0 in (0..C).step_by(V_CHUNK) {
        let at = |h: usize, c: usize| h * hd + 16 * (c0 + c);
        // SAFETY: 16 f32 at `at(h, c)` lie within `acc` (asserted length, `c0 + c < C`).
        let mut a: [[__m512; V_CHUNK]; H] = std::array::from_fn(|h| {
            std::array::from_fn(|c| unsafe { _mm512_loadu_ps(acc.as_ptr().add(at(h, c))) })
        });
        for j in lo..hi {
            let vr = &vf[j * hd + 16 * c0..j * hd + 16 * (c0 + V_CHUNK)];
            let w: [__m512; H] = std::array::from_fn(|h| _mm512_set1_ps(weights[h][j]));
            for c in 0..V_CHUNK {
                // SAFETY: 16 f32 at 16*c lie within `vr` (sliced to `16 * V_CHUNK`).
                let x = unsafe { _mm512_loadu_ps(vr.as_ptr().add(16 * c)) };
                for (ah, wh) in a.iter_mut().zip(&w) {
                    ah[c] = _mm512_fmadd_ps(*wh, x, ah[c]);
                }
            }
        }
        for (h, ah) in a.iter().enumerate() {
            for (c, x) in ah.iter().enumerate() {
                // SAFETY: as for the loads.
                unsafe { _mm512_storeu_ps(acc.as_mut_ptr().add(at(h, c)), *x) };
            }
        }
    }
}

/// Registers of a head's accumulator that [`wide_v_updates`] keeps over a block: four
/// heads × four, sixteen accumulators beside the V loads and the weights.
const V_CHUNK: usize = 4;

/// [`super::attend_rows`] compiled for AVX2, FMA and F16C (`HD`: the head size, or 0 for
/// `shape.hd`).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attend_rows_256<T: super::KvElem, const HD: usize>(
    q: &[f32],
    shape: &super::RowsShape,
    k: &[&[T]],
    v: &[&[T]],
    out: &mut [f32],
) {
    super::attend_rows_with::<T, Narrow, HD>(q, shape, k, v, out);
}

/// [`super::attend_rows`] compiled for AVX-512 (`HD` as for [`attend_rows_256`]).
///
/// # Safety
/// The CPU must support AVX-512 F, BW, DQ and VL, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
pub unsafe fn attend_rows_512<T: super::KvElem, const HD: usize>(
    q: &[f32],
    shape: &super::RowsShape,
    k: &[&[T]],
    v: &[&[T]],
    out: &mut [f32],
) {
    super::attend_rows_with::<T, Wide, HD>(q, shape, k, v, out);
}

/// `out[i] = f32(f16(q[i]))` (to nearest even, as the scalar conversion) over whole
/// groups of 8; returns how many were done.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn round_f16_slice(q: &[f32], out: &mut [f32]) -> usize {
    let mut done = 0;
    for (o, x) in out.chunks_exact_mut(8).zip(q.chunks_exact(8)) {
        // SAFETY: both chunks are 8 f32; unaligned loads and stores are allowed.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), round_f16_256(_mm256_loadu_ps(x.as_ptr()))) };
        done += 8;
    }
    done
}

/// `x` rounded to f16 (to nearest even) and back: what storing the accumulator in the
/// cache's element type and reading it again gives.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn round_f16_256(x: __m256) -> __m256 {
    _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT))
}
