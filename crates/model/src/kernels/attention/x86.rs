//! The x86 builds of the f16 attention (256- and 512-bit) and their building blocks.

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

/// `acc[i] = f16(fma(v[i], w, acc[i]))`, the same single rounding per element as the
/// scalar path (f16 conversion rounds to nearest even in both), so they agree bit for bit.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `acc.len() == v.len()`, a multiple of 8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn mad_f16(acc: &mut [half::f16], v: &[half::f16], w: f32) {
    let wv = _mm256_set1_ps(w);
    for (ac, vc) in acc.chunks_exact_mut(8).zip(v.chunks_exact(8)) {
        // SAFETY: each chunk is 8 f16 values (16 bytes) in bounds; unaligned loads and
        // stores are allowed.
        unsafe {
            let x = _mm256_cvtph_ps(_mm_loadu_si128(vc.as_ptr() as *const __m128i));
            let a = _mm256_cvtph_ps(_mm_loadu_si128(ac.as_ptr() as *const __m128i));
            let r = _mm256_cvtps_ph(_mm256_fmadd_ps(x, wv, a), _MM_FROUND_TO_NEAREST_INT);
            _mm_storeu_si128(ac.as_mut_ptr() as *mut __m128i, r);
        }
    }
}

/// [`super::attend_portable`] for up to [`super::MAX_HEADS`] query heads that read the
/// same f16 K/V rows of length 64, 128 or 256, each head computed exactly as the
/// portable path computes it: the K·Q steps of [`dot_f16_ggml_steps`], the same `exp`,
/// an f16 rounding after every `acc * s` and every `fma(v, w, acc)`, so the same bits.
///
/// Why it is faster: each head's V sum is a chain of dependent roundings, so one head
/// alone waits on latency. The heads' chains are independent, so they are interleaved
/// (and each K/V row is converted once for all of them); the scores and `exp` calls of a
/// block of keys are computed ahead ([`super::Plan`]), leaving only the V updates serial.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `qs.len() == outs.len()`, between 1 and
/// [`super::MAX_HEADS`]; every query, output and row of `k` and `v` has the same
/// length, 64, 128 or 256.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attend_f16(
    qs: &[&[f32]],
    k: &[&[half::f16]],
    v: &[&[half::f16]],
    scale: f32,
    outs: &mut [&mut [f32]],
) {
    match (qs[0].len(), qs.len()) {
        (64, 1) => narrow::<8, 1>(qs, k, v, scale, outs),
        (64, _) => narrow::<8, 2>(qs, k, v, scale, outs),
        (128, _) => narrow::<16, 1>(qs, k, v, scale, outs),
        _ => narrow::<32, 1>(qs, k, v, scale, outs),
    }
}

/// [`attend_f16`] for `8 * C` lanes, `H` heads at a time (the rest in further passes):
/// 16 ymm registers hold two 64-lane accumulators at most.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn narrow<const C: usize, const H: usize>(
    qs: &[&[f32]],
    k: &[&[half::f16]],
    v: &[&[half::f16]],
    scale: f32,
    outs: &mut [&mut [f32]],
) {
    for (qs, outs) in qs.chunks(H).zip(outs.chunks_mut(H)) {
        let heads = qs.len();
        let mut acc = [[_mm256_setzero_ps(); C]; H];
        let mut plans = [super::Plan::default(); H];
        for (b, (kb, vb)) in k
            .chunks(super::KEY_BLOCK)
            .zip(v.chunks(super::KEY_BLOCK))
            .enumerate()
        {
            for (j, kr) in kb.iter().enumerate() {
                // As in `wide`.
                let at = b * super::KEY_BLOCK + j;
                if let Some(ahead) = v.get(at + V_PREFETCH_AHEAD) {
                    prefetch_row(ahead);
                }
                if let Some(ahead) = k.get(at + K_PREFETCH_AHEAD) {
                    prefetch_row(ahead);
                }
                for (plan, q) in plans.iter_mut().zip(qs) {
                    // SAFETY: query and row have the head's length, a multiple of 64
                    // (the caller's contract).
                    plan.set_score(j, unsafe { dot_f16_ggml_steps(q, kr) } * scale);
                }
            }
            for plan in plans.iter_mut().take(heads) {
                plan.settle(kb.len());
            }
            for (j, vr) in vb.iter().enumerate() {
                assert!(vr.len() == 8 * C);
                let mut x = [_mm256_setzero_ps(); C];
                for (c, x) in x.iter_mut().enumerate() {
                    // SAFETY: 8 f16 values at 8*c lie within the row (asserted
                    // length); unaligned loads are allowed.
                    *x = unsafe {
                        _mm256_cvtph_ps(_mm_loadu_si128(vr.as_ptr().add(8 * c) as *const __m128i))
                    };
                }
                for (plan, acc) in plans.iter_mut().zip(acc.iter_mut()).take(heads) {
                    let (ms, vs) = plan.weights(j);
                    if plan.rescales(j) {
                        let m = _mm256_set1_ps(ms);
                        for a in acc.iter_mut() {
                            *a = round_f16_256(_mm256_mul_ps(*a, m));
                        }
                    }
                    let w = _mm256_set1_ps(vs);
                    for (a, x) in acc.iter_mut().zip(x) {
                        *a = round_f16_256(_mm256_fmadd_ps(x, w, *a));
                    }
                    plan.add_to_sum(ms, vs);
                }
            }
        }
        for ((plan, acc), out) in plans.iter().zip(&acc).zip(outs.iter_mut()) {
            let inv = plan.inverse_sum();
            assert!(out.len() == 8 * C);
            for (a, o) in acc.iter().zip(out.chunks_exact_mut(8)) {
                let mut lanes = [0f32; 8];
                // SAFETY: `lanes` is 8 writable f32; unaligned stores are allowed.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *a) };
                for (o, x) in o.iter_mut().zip(lanes) {
                    *o = x * inv;
                }
            }
        }
    }
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

/// [`round_f16_256`] on 16 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
fn round_f16_512(x: __m512) -> __m512 {
    _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT))
}

/// [`attend_f16`] with 16-lane registers: ggml's K·Q order is defined on 16-lane
/// accumulators (the 256-bit path holds each as two halves), and the V updates are
/// lane-wise, so this is the same arithmetic in half the instructions; 32 registers
/// hold more heads' accumulators at once.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, DQ and VL, FMA and F16C; arguments as for
/// [`attend_f16`].
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
pub unsafe fn attend_f16_wide(
    qs: &[&[f32]],
    k: &[&[half::f16]],
    v: &[&[half::f16]],
    scale: f32,
    outs: &mut [&mut [f32]],
) {
    match (qs[0].len(), qs.len()) {
        (64, 1) => wide::<4, 1>(qs, k, v, scale, outs),
        (64, 2) => wide::<4, 2>(qs, k, v, scale, outs),
        (64, 3) => wide::<4, 3>(qs, k, v, scale, outs),
        (64, _) => wide::<4, 4>(qs, k, v, scale, outs),
        (128, 1) => wide::<8, 1>(qs, k, v, scale, outs),
        (128, _) => wide::<8, 2>(qs, k, v, scale, outs),
        (256, 1) => wide::<16, 1>(qs, k, v, scale, outs),
        _ => wide::<16, 2>(qs, k, v, scale, outs),
    }
}

/// [`attend_f16_wide`] for `16 * C` lanes, `H` heads at a time.
///
/// The K·Q products of the next block of keys run in the same loop as the V updates of
/// the current one: the updates are bound by f16 conversions and the products by FMAs,
/// different units, which one phase after the other would leave idle in turn.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
fn wide<const C: usize, const H: usize>(
    qs: &[&[f32]],
    k: &[&[half::f16]],
    v: &[&[half::f16]],
    scale: f32,
    outs: &mut [&mut [f32]],
) {
    const B: usize = super::KEY_BLOCK;
    let n = k.len().min(v.len());
    for (qs, outs) in qs.chunks(H).zip(outs.chunks_mut(H)) {
        let heads = qs.len();
        let mut acc = [[_mm512_setzero_ps(); C]; H];
        let mut plans = [super::Plan::default(); H];
        let mut next = Scores::<H>::new(scale);
        let first = n.min(B);
        for j in 0..first {
            next.product::<C>(qs, k, j, first);
        }
        for (plan, scores) in plans.iter_mut().zip(&next.scores).take(heads) {
            settle_wide(plan, scores, first);
        }
        for b0 in (0..n).step_by(B) {
            let len = (n - b0).min(B);
            let ahead = b0 + len;
            let ahead_len = (n - ahead).min(B);
            for j in 0..len {
                if j < ahead_len {
                    next.product::<C>(qs, k, ahead + j, ahead_len);
                }
                let vr = v[b0 + j];
                // A long context's rows come from memory (the weights streamed through
                // the caches since this layer last ran), 128 bytes per page-strided row,
                // which the hardware prefetcher does not run ahead of: ask for the next
                // block's V rows (and, in `product`, K rows two blocks before their use;
                // measured best of 8..64 ahead: +8% decode at 512 positions).
                if let Some(row) = v.get(b0 + j + V_PREFETCH_AHEAD) {
                    prefetch_wide_row::<C>(row);
                }
                assert!(vr.len() == 16 * C);
                let mut x = [_mm512_setzero_ps(); C];
                for (c, x) in x.iter_mut().enumerate() {
                    // SAFETY: 16 f16 values at 16*c lie within the row (asserted
                    // length); unaligned loads are allowed.
                    *x = unsafe {
                        _mm512_cvtph_ps(_mm256_loadu_si256(
                            vr.as_ptr().add(16 * c) as *const __m256i
                        ))
                    };
                }
                for (plan, acc) in plans.iter_mut().zip(acc.iter_mut()).take(heads) {
                    let (ms, vs) = plan.weights(j);
                    if plan.rescales(j) {
                        let m = _mm512_set1_ps(ms);
                        for a in acc.iter_mut() {
                            *a = round_f16_512(_mm512_mul_ps(*a, m));
                        }
                    }
                    let w = _mm512_set1_ps(vs);
                    for (a, x) in acc.iter_mut().zip(x) {
                        *a = round_f16_512(_mm512_fmadd_ps(x, w, *a));
                    }
                    plan.add_to_sum(ms, vs);
                }
            }
            if ahead_len > 0 {
                for (plan, scores) in plans.iter_mut().zip(&next.scores).take(heads) {
                    settle_wide(plan, scores, ahead_len);
                }
            }
        }
        for ((plan, acc), out) in plans.iter().zip(&acc).zip(outs.iter_mut()) {
            let inv = plan.inverse_sum();
            assert!(out.len() == 16 * C);
            for (a, o) in acc.iter().zip(out.chunks_exact_mut(16)) {
                let mut lanes = [0f32; 16];
                // SAFETY: `lanes` is 16 writable f32; unaligned stores are allowed.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *a) };
                for (o, x) in o.iter_mut().zip(lanes) {
                    *o = x * inv;
                }
            }
        }
    }
}

/// [`super::Plan::settle_from`] for the first `n` of `scores`, the running maximum as a
/// prefix maximum across 16 lanes: the maximum is exact and, with no NaN among the
/// scores, order-free, so each key sees the same maximum before it as in the
/// one-key-at-a-time loop (which runs instead where a score is NaN). Only the sign of a
/// zero maximum can differ, which changes no `exp` argument but the sign of a zero one,
/// and exp(+0) = exp(-0) = 1.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
fn settle_wide(plan: &mut super::Plan, scores: &[f32; super::KEY_BLOCK], n: usize) {
    // Shifts lanes up by `BY` (an `alignr` count of `16 - BY`), `fill` coming in.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
    fn up<const SHIFT: i32>(x: __m512, fill: __m512) -> __m512 {
        _mm512_castsi512_ps(_mm512_alignr_epi32::<SHIFT>(
            _mm512_castps_si512(x),
            _mm512_castps_si512(fill),
        ))
    }
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut s = [ninf; super::KEY_BLOCK / 16];
    let mut nan = 0u16;
    for (i, s) in s.iter_mut().enumerate() {
        let valid = ((1u32 << n.saturating_sub(16 * i).min(16)) - 1) as u16;
        // SAFETY: 16 f32 at 16*i lie within `scores`; unaligned loads are allowed.
        let x = unsafe { _mm512_loadu_ps(scores.as_ptr().add(16 * i)) };
        nan |= _mm512_mask_cmp_ps_mask::<_CMP_UNORD_Q>(valid, x, x);
        // Keys past the block's end never raise the maximum.
        *s = _mm512_mask_mov_ps(ninf, valid, x);
    }
    if nan != 0 {
        plan.settle_from(&scores[..n]);
        return;
    }
    let mut zero = 0u32;
    for (i, s) in s.into_iter().enumerate() {
        if 16 * i >= n {
            break;
        }
        let mut p = _mm512_max_ps(s, up::<15>(s, ninf));
        p = _mm512_max_ps(p, up::<14>(p, ninf));
        p = _mm512_max_ps(p, up::<12>(p, ninf));
        p = _mm512_max_ps(p, up::<8>(p, ninf));
        let m0 = _mm512_set1_ps(plan.max);
        // The maximum before each key: the carried one, then the keys before it.
        let before = _mm512_max_ps(up::<15>(p, m0), m0);
        let raises = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(s, before);
        let e = _mm512_mask_sub_ps(_mm512_sub_ps(s, before), raises, before, s);
        // exp(-inf) is +0 in every libm, but the vector `exp` treats -inf as a special
        // input and computes its whole group of 16 with scalar calls: the first key's
        // rescale (from the initial -inf maximum) is set to its known value afterwards.
        let nothing = _mm512_mask_cmp_ps_mask::<_CMP_EQ_OQ>(raises, before, ninf);
        zero |= (nothing as u32) << (16 * i);
        let e = _mm512_mask_mov_ps(e, nothing, _mm512_setzero_ps());
        let out = &mut plan.exp[16 * i..16 * i + 16];
        let flags = &mut plan.raises[16 * i..16 * i + 16];
        // SAFETY: `out` is 16 writable f32, `flags` 16 writable bools, written with 0 or 1
        // (valid bools); unaligned stores are allowed.
        unsafe {
            _mm512_storeu_ps(out.as_mut_ptr(), e);
            _mm_storeu_si128(
                flags.as_mut_ptr() as *mut __m128i,
                _mm_maskz_mov_epi8(raises, _mm_set1_epi8(1)),
            );
        }
        // Lane 15 of the prefix maximum: the block's last key (the rest are -inf).
        let top = _mm512_max_ps(p, m0);
        plan.max = _mm512_cvtss_f32(_mm512_permutexvar_ps(_mm512_set1_epi32(15), top));
    }
    super::super::libm_expf::expf_in_place(&mut plan.exp[..n]);
    while zero != 0 {
        plan.exp[zero.trailing_zeros() as usize] = 0.0;
        zero &= zero - 1;
    }
}

/// The scores of one block of keys for up to `H` heads, computed ahead of their use.
struct Scores<const H: usize> {
    /// Per head, the 16-lane sums of up to 16 keys awaiting their lane trees.
    lanes: [[__m512; 16]; H],
    /// Per head, `dot * scale` of each key of the block.
    scores: [[f32; super::KEY_BLOCK]; H],
    scale: __m512,
}

impl<const H: usize> Scores<H> {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
    fn new(scale: f32) -> Self {
        Self {
            lanes: [[_mm512_setzero_ps(); 16]; H],
            scores: [[0.0; super::KEY_BLOCK]; H],
            scale: _mm512_set1_ps(scale),
        }
    }

    /// Key `at` (of a block of `len` keys from a multiple of `KEY_BLOCK`) against every
    /// head's query: its lane sums, and after each 16 keys or the block's last, their
    /// scores, the lane trees of 16 keys at once (a third of the shuffles and adds of one
    /// tree per key, and one multiply and store for all 16).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
    fn product<const C: usize>(
        &mut self,
        qs: &[&[f32]],
        k: &[&[half::f16]],
        at: usize,
        len: usize,
    ) {
        if let Some(row) = k.get(at + K_PREFETCH_AHEAD) {
            prefetch_wide_row::<C>(row);
        }
        let kr = k[at];
        assert!(kr.len() == 16 * C);
        let mut x = [_mm512_setzero_ps(); C];
        for (c, x) in x.iter_mut().enumerate() {
            // SAFETY: 16 f16 values at 16*c lie within the row (asserted length);
            // unaligned loads are allowed.
            *x = unsafe {
                _mm512_cvtph_ps(_mm256_loadu_si256(kr.as_ptr().add(16 * c) as *const __m256i))
            };
        }
        let j = at % super::KEY_BLOCK;
        for (lanes, q) in self.lanes.iter_mut().zip(qs) {
            lanes[j % 16] = dot_lanes(q, &x);
        }
        if j % 16 == 15 || j + 1 == len {
            let from = j - j % 16;
            let mask = (((1u32 << (j % 16 + 1)) - 1) & 0xffff) as u16;
            for (lanes, scores) in self.lanes.iter().zip(self.scores.iter_mut()).take(qs.len()) {
                let s = _mm512_mul_ps(reduce_16x16(lanes), self.scale);
                let out = &mut scores[from..from + 16];
                // SAFETY: `out` is 16 writable f32; only the lanes of keys computed are
                // written, and unaligned stores are allowed.
                unsafe { _mm512_mask_storeu_ps(out.as_mut_ptr(), mask, s) };
            }
        }
    }
}

/// [`dot_f16_ggml_steps`] on 16-lane registers up to its lane tree, the K row already
/// converted: 64-lane steps into four accumulators, reduced `(a0 + a2) + (a1 + a3)`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
fn dot_lanes<const C: usize>(q: &[f32], k: &[__m512; C]) -> __m512 {
    assert!(q.len() == 16 * C);
    let mut acc = [_mm512_setzero_ps(); 4];
    for (c, kx) in k.iter().enumerate() {
        // SAFETY: 16 elements at 16*c lie within `q` (asserted length); unaligned loads
        // are allowed.
        let qv = unsafe { _mm512_loadu_ps(q.as_ptr().add(16 * c)) };
        acc[c % 4] = _mm512_fmadd_ps(qv, *kx, acc[c % 4]);
    }
    _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]))
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

/// Keys between a row's prefetch and its use.
const K_PREFETCH_AHEAD: usize = 2 * super::KEY_BLOCK;
const V_PREFETCH_AHEAD: usize = super::KEY_BLOCK;

/// [`prefetch_row`] for a row of `16 * C` elements, unrolled.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn prefetch_wide_row<const C: usize>(row: &[half::f16]) {
    for at in (0..16 * C).step_by(32) {
        // A prefetch reads nothing and cannot fault; `wrapping_add` needs no bounds.
        _mm_prefetch::<_MM_HINT_T0>(row.as_ptr().wrapping_add(at) as *const i8);
    }
}

/// Asks for every cache line of `row`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn prefetch_row(row: &[half::f16]) {
    for line in row.chunks(32) {
        // A prefetch reads nothing and cannot fault; the address is inside `row`.
        _mm_prefetch::<_MM_HINT_T0>(line.as_ptr() as *const i8);
    }
}
