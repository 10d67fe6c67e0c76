//! The 256- and 512-bit builds of the attention arithmetic (`super::attend_rows_with`
//! compiled with those instruction sets) and the vector steps they do it with.

use std::arch::x86_64::*;

use super::super::x86::hsum;

/// [`super::dot_f16_ggml`] over whole 64-element steps, 16-lane accumulators held as
/// pairs of 8-lane halves; the final cross-lane tree is `hsum` of `hi + lo`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `q.len() == k.len()`, a multiple of 64.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f16_ggml_steps(q: &[f32], k: &[half::f16]) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 8]; // [j * 2 + half]
    for (qc, kc) in q.chunks_exact(64).zip(k.chunks_exact(64)) {
        for (h, a) in acc.iter_mut().enumerate() {
            // SAFETY: 8 elements at offset 8*h lie within the 64-element chunks;
            // unaligned loads are allowed.
            unsafe {
                let qv = _mm256_loadu_ps(qc.as_ptr().add(h * 8));
                let kv = _mm256_cvtph_ps(_mm_loadu_si128(kc.as_ptr().add(h * 8) as *const __m128i));
                *a = _mm256_fmadd_ps(qv, kv, *a);
            }
        }
    }
    // Accumulator j covers lanes 16j..16j+16: halves (lo, hi) = acc[2j], acc[2j+1].
    let lo = _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));
    let hi = _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
    hsum(_mm256_add_ps(hi, lo))
}

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
    fn reduce_keys(lanes: &[[f32; 16]; 16]) -> [f32; 16] {
        std::array::from_fn(|j| super::reduce16(&lanes[j]))
    }

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
    fn reduce_keys(lanes: &[[f32; 16]; 16]) -> [f32; 16] {
        let mut out = [0f32; 16];
        // SAFETY: as in `row_block`; the loads read 16 f32 from each `[f32; 16]` and the
        // store writes 16 f32 into `out`, unaligned accesses allowed.
        unsafe {
            let v: [__m512; 16] = std::array::from_fn(|j| _mm512_loadu_ps(lanes[j].as_ptr()));
            _mm512_storeu_ps(out.as_mut_ptr(), reduce_16x16(&v));
        }
        out
    }

    #[inline(always)]
    fn exp(xs: &mut [f32]) {
        super::super::libm_expf::expf_in_place(xs);
    }
}

/// [`super::row_block_with`] for heads of `16 * C` in 512-bit registers, the same operations
/// in the same order: each head's query in registers, 16 keys' lane sums reduced at once,
/// the block's maximum over the valid lanes (NaN excluded, as the definition's `>`
/// comparisons exclude it; only a zero maximum's sign can differ, which changes no `exp`
/// argument but a zero one's sign), and the V updates of up to `16 / C` heads interleaved
/// with their accumulators in registers (independent chains; each head's keys in order).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
fn wide_row_block<const C: usize>(
    b: super::RowBlock<'_>,
    max: &mut [f32],
    sums: &mut [[f32; 16]],
    acc: &mut [f32],
) {
    const B: usize = super::KEY_BLOCK;
    let hd = 16 * C;
    let heads = max.len();
    let super::RowBlock {
        q,
        kf,
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
            && kf.len() >= B * hd
            && vf.len() >= B * hd
            && lo < hi
            && hi <= B
    );
    // Valid keys of the block's two groups of 16.
    let span = ((1u64 << hi) - 1) & !((1u64 << lo) - 1);
    let masks = [span as u16, (span >> 16) as u16];
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let scale_v = _mm512_set1_ps(scale);
    let per_pass = (16 / C).clamp(1, 4);
    for h0 in (0..heads).step_by(per_pass) {
        let n = (heads - h0).min(per_pass);
        let mut weights = [[0f32; B]; 4];
        let mut live = [false; 4];
        for i in 0..n {
            let h = h0 + i;
            let qh = &q[h * hd..(h + 1) * hd];
            // SAFETY: 16 f32 at 16*c lie within the head's `hd` (= 16*C) elements.
            let qv: [__m512; C] =
                std::array::from_fn(|c| unsafe { _mm512_loadu_ps(qh.as_ptr().add(16 * c)) });
            let mut s = [ninf; 2];
            for (g, (s, &mask)) in s.iter_mut().zip(&masks).enumerate() {
                if mask == 0 {
                    continue;
                }
                let mut lanes = [_mm512_setzero_ps(); 16];
                for (j, lane) in lanes.iter_mut().enumerate() {
                    if mask >> j & 1 == 0 {
                        continue;
                    }
                    let kr = &kf[(16 * g + j) * hd..(16 * g + j + 1) * hd];
                    let mut a = [_mm512_setzero_ps(); 4];
                    for (c, qc) in qv.iter().enumerate() {
                        // SAFETY: 16 f32 at 16*c lie within the key's `hd` elements.
                        let kc = unsafe { _mm512_loadu_ps(kr.as_ptr().add(16 * c)) };
                        a[c % 4] = _mm512_fmadd_ps(*qc, kc, a[c % 4]);
                    }
                    *lane = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
                }
                let scores = _mm512_mul_ps(reduce_16x16(&lanes), scale_v);
                *s = _mm512_mask_mov_ps(ninf, mask, scores);
            }
            let m = {
                let ordered = |x: __m512, mask: u16| {
                    let keep = mask & _mm512_cmp_ps_mask::<_CMP_ORD_Q>(x, x);
                    _mm512_mask_reduce_max_ps(keep, x)
                };
                let (m0, m1) = (ordered(s[0], masks[0]), ordered(s[1], masks[1]));
                if m1 > m0 {
                    m1
                } else {
                    m0
                }
            };
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
            // vector `exp`) and are cleared after.
            // SAFETY: `w` is 32 f32: two stores of 16, unaligned allowed.
            unsafe {
                _mm512_storeu_ps(w.as_mut_ptr(), _mm512_maskz_sub_ps(masks[0], s[0], mv));
                _mm512_storeu_ps(
                    w.as_mut_ptr().add(16),
                    _mm512_maskz_sub_ps(masks[1], s[1], mv),
                );
            }
            super::super::libm_expf::expf_in_place(w);
            // SAFETY: `w` is 32 f32 and `sums[h]` 16: loads and stores of 16, unaligned
            // allowed.
            unsafe {
                let w0 = _mm512_maskz_mov_ps(masks[0], _mm512_loadu_ps(w.as_ptr()));
                let w1 = _mm512_maskz_mov_ps(masks[1], _mm512_loadu_ps(w.as_ptr().add(16)));
                _mm512_storeu_ps(w.as_mut_ptr(), w0);
                _mm512_storeu_ps(w.as_mut_ptr().add(16), w1);
                let sv = _mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(sums[h].as_ptr()), w0), w1);
                _mm512_storeu_ps(sums[h].as_mut_ptr(), sv);
            }
        }
        let pass = &mut acc[h0 * hd..(h0 + n) * hd];
        if live[..n].iter().all(|&l| l) {
            match n {
                4 => wide_v_updates::<C, 4>(&weights, vf, lo, hi, pass),
                3 => wide_v_updates::<C, 3>(&weights, vf, lo, hi, pass),
                2 => wide_v_updates::<C, 2>(&weights, vf, lo, hi, pass),
                _ => wide_v_updates::<C, 1>(&weights, vf, lo, hi, pass),
            }
        } else {
            for i in (0..n).filter(|&i| live[i]) {
                let one = &mut pass[i * hd..(i + 1) * hd];
                wide_v_updates::<C, 1>(&weights[i..i + 1], vf, lo, hi, one);
            }
        }
    }
}

/// `acc_i = fma(w_i[j], v_j, acc_i)` for keys `lo..hi` in order, for `H` heads whose
/// accumulators (`16 * C` each, consecutive in `acc`) stay in registers for the block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
fn wide_v_updates<const C: usize, const H: usize>(
    weights: &[[f32; super::KEY_BLOCK]],
    vf: &[f32],
    lo: usize,
    hi: usize,
    acc: &mut [f32],
) {
    let hd = 16 * C;
    assert!(weights.len() >= H && acc.len() >= H * hd && vf.len() >= hi * hd);
    // SAFETY: 16 f32 at (h * hd + 16 * c) lie within `acc` (asserted length).
    let mut a: [[__m512; C]; H] = std::array::from_fn(|h| {
        std::array::from_fn(|c| unsafe { _mm512_loadu_ps(acc.as_ptr().add(h * hd + 16 * c)) })
    });
    for j in lo..hi {
        let vr = &vf[j * hd..(j + 1) * hd];
        let w: [__m512; H] = std::array::from_fn(|h| _mm512_set1_ps(weights[h][j]));
        for c in 0..C {
            // SAFETY: 16 f32 at 16*c lie within the key's `hd` elements.
            let x = unsafe { _mm512_loadu_ps(vr.as_ptr().add(16 * c)) };
            for (ah, wh) in a.iter_mut().zip(&w) {
                ah[c] = _mm512_fmadd_ps(*wh, x, ah[c]);
            }
        }
    }
    for (h, ah) in a.iter().enumerate() {
        for (c, x) in ah.iter().enumerate() {
            // SAFETY: as for the loads.
            unsafe { _mm512_storeu_ps(acc.as_mut_ptr().add(h * hd + 16 * c), *x) };
        }
    }
}

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

/// Lane `i` of the result is `hsum(hi + lo)` of `v[i]` (the tree of
/// [`super::reduce16`]: lane `l + 8` onto `l`, then `l + 4` onto `l`, then
/// `(t0 + t2) + (t1 + t3)`), for all 16 at once by transposing shuffles: each step adds
/// the same pairs as the one-vector tree, two, four, eight then sixteen vectors per
/// register.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
fn reduce_16x16(v: &[__m512; 16]) -> __m512 {
    // The last step leaves input slot `s` at lane `4 * (s % 4) + s / 4`; reading the
    // inputs in the inverse order (the same map: a 4x4 transpose) puts key `i` at lane `i`.
    let at = |s: usize| v[4 * (s % 4) + s / 4];
    // 256-bit halves added: slot pair (2p, 2p+1) -> [t3 of 2p | t3 of 2p+1].
    let w: [__m512; 8] = std::array::from_fn(|p| {
        let (a, b) = (at(2 * p), at(2 * p + 1));
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xEE>(a, b),
        )
    });
    // 128-bit quarters added: 128-bit lane `l` of `u[p]` is t6 of slot `4p + l`.
    let u: [__m512; 4] = std::array::from_fn(|p| {
        let (x, y) = (w[2 * p], w[2 * p + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(x, y),
            _mm512_shuffle_f32x4::<0xDD>(x, y),
        )
    });
    // Within each 128-bit lane `l`: [t6_0 + t6_2, t6_1 + t6_3] of slots 8p + l, 8p + 4 + l.
    let z: [__m512; 2] = std::array::from_fn(|p| {
        let (e, f) = (u[2 * p], u[2 * p + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(e, f),
            _mm512_shuffle_ps::<0xEE>(e, f),
        )
    });
    // Element `e` of 128-bit lane `l`: slot `l + 4e`.
    _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(z[0], z[1]),
        _mm512_shuffle_ps::<0xDD>(z[0], z[1]),
    )
}
