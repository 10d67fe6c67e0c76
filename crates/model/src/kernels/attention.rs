//! The attention arithmetic over the KV cache's element types, in the order of llama.cpp's
//! CPU flash-attention kernel.

use super::dot_f32;
#[cfg(target_arch = "x86_64")]
use super::has_f16c;

/// Element types of the KV cache, with the operations attention needs. The accumulator of
/// the weighted V sum has the cache's own precision, as in llama.cpp's kernel.
pub trait KvElem: Copy + Send + Sync {
    type Acc: Copy + Default + Send;
    /// The query as the product sees it.
    fn round_query(x: f32) -> f32;
    /// `Σ q[i] * k[i]`, eight running lanes then a fixed reduction.
    fn dot(q: &[f32], k: &[Self]) -> f32;
    fn acc_clear(acc: &mut [Self::Acc]);
    /// `acc[i] *= s`.
    fn acc_scale(acc: &mut [Self::Acc], s: f32);
    /// `acc[i] = fma(v[i], w, acc[i])`, rounded to the accumulator type.
    fn acc_mad(acc: &mut [Self::Acc], v: &[Self], w: f32);
    /// `out[i] = acc[i] * inv`.
    fn acc_finish(acc: &[Self::Acc], inv: f32, out: &mut [f32]);

    /// One query head over its visible positions (`k[j]`, `v[j]` for each), as llama.cpp's
    /// CPU flash-attention kernel computes it: one pass in position order with a running
    /// maximum, the V sum accumulated in [`Self::Acc`] with a rounding after every update,
    /// normalized at the end. The order is fixed, so the result does not depend on the batch.
    fn attend(
        q: &[f32],
        k: &[&[Self]],
        v: &[&[Self]],
        scale: f32,
        acc: &mut [Self::Acc],
        out: &mut [f32],
    ) {
        attend_portable(q, k, v, scale, acc, out);
    }
}

/// [`KvElem::attend`] through the element type's operations, one call per step.
pub fn attend_portable<T: KvElem>(
    q: &[f32],
    k: &[&[T]],
    v: &[&[T]],
    scale: f32,
    acc: &mut [T::Acc],
    out: &mut [f32],
) {
    T::acc_clear(acc);
    let mut max = f32::NEG_INFINITY;
    let mut sum = 0f32;
    for (kr, vr) in k.iter().zip(v) {
        let s = T::dot(q, kr) * scale;
        let mut ms = 1.0f32;
        let mut vs = 1.0f32;
        if s > max {
            let old = max;
            max = s;
            ms = (old - max).exp();
            T::acc_scale(acc, ms);
        } else {
            vs = (s - max).exp();
        }
        T::acc_mad(acc, vr, vs);
        sum = sum.mul_add(ms, vs);
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    T::acc_finish(acc, inv, out);
}

impl KvElem for f32 {
    type Acc = f32;

    fn round_query(x: f32) -> f32 {
        x
    }

    fn dot(q: &[f32], k: &[f32]) -> f32 {
        dot_f32(q, k)
    }

    fn acc_clear(acc: &mut [f32]) {
        acc.fill(0.0);
    }

    fn acc_scale(acc: &mut [f32], s: f32) {
        for a in acc.iter_mut() {
            *a *= s;
        }
    }

    fn acc_mad(acc: &mut [f32], v: &[f32], w: f32) {
        for (a, &x) in acc.iter_mut().zip(v) {
            *a = x.mul_add(w, *a);
        }
    }

    fn acc_finish(acc: &[f32], inv: f32, out: &mut [f32]) {
        for (o, &a) in out.iter_mut().zip(acc) {
            *o = a * inv;
        }
    }
}

impl KvElem for half::f16 {
    type Acc = half::f16;

    fn round_query(x: f32) -> f32 {
        half::f16::from_f32(x).to_f32()
    }

    fn dot(q: &[f32], k: &[half::f16]) -> f32 {
        dot_f16_ggml(q, k)
    }

    fn acc_clear(acc: &mut [half::f16]) {
        acc.fill(half::f16::ZERO);
    }

    fn acc_scale(acc: &mut [half::f16], s: f32) {
        for a in acc.iter_mut() {
            *a = half::f16::from_f32(a.to_f32() * s);
        }
    }

    fn acc_mad(acc: &mut [half::f16], v: &[half::f16], w: f32) {
        #[cfg(target_arch = "x86_64")]
        if has_f16c() && acc.len() == v.len() && acc.len().is_multiple_of(8) {
            // SAFETY: AVX2, FMA and F16C are present (checked) and the slices have equal
            // lengths that are a multiple of 8, as the function requires.
            unsafe { x86::mad_f16(acc, v, w) };
            return;
        }
        for (a, &x) in acc.iter_mut().zip(v) {
            *a = half::f16::from_f32(x.to_f32().mul_add(w, a.to_f32()));
        }
    }

    fn acc_finish(acc: &[half::f16], inv: f32, out: &mut [f32]) {
        for (o, &a) in out.iter_mut().zip(acc) {
            *o = a.to_f32() * inv;
        }
    }

    fn attend(
        q: &[f32],
        k: &[&[half::f16]],
        v: &[&[half::f16]],
        scale: f32,
        acc: &mut [half::f16],
        out: &mut [f32],
    ) {
        let hd = q.len();
        #[cfg(target_arch = "x86_64")]
        if has_f16c()
            && hd > 0
            && hd.is_multiple_of(64)
            && acc.len() == hd
            && out.len() == hd
            && k.iter().chain(v).all(|r| r.len() == hd)
        {
            if super::features().wide {
                // SAFETY: AVX-512 F, BW, DQ, VL with F16C and FMA are present (checked); the
                // lengths are as required (checked).
                unsafe { x86::attend_f16_wide(q, k, v, scale, acc, out) };
                return;
            }
            // SAFETY: AVX2, FMA and F16C are present (checked); every row, the accumulator
            // and the output have the head's length, a multiple of 64, as required.
            unsafe { x86::attend_f16(q, k, v, scale, acc, out) };
            return;
        }
        attend_portable(q, k, v, scale, acc, out);
    }
}

/// `Σ q[i] * k[i]` for f16-valued `q` and `k`, in exactly the order of ggml's AVX-512
/// `ggml_vec_dot_f16` (llama.cpp's K·Q product): 64-element steps into four 16-lane
/// accumulators, reduced `(s0 + s2) + (s1 + s3)` then as a tree across lanes; elements past
/// the last whole step are added in f64.
pub fn dot_f16_ggml(q: &[f32], k: &[half::f16]) -> f32 {
    let n = q.len().min(k.len());
    let np = n & !63;
    #[cfg(target_arch = "x86_64")]
    if np > 0 && has_f16c() {
        // SAFETY: AVX2, FMA and F16C are present (checked); `np` is a multiple of 64 no
        // larger than either slice, as the function requires.
        let head = unsafe { x86::dot_f16_ggml_steps(&q[..np], &k[..np]) };
        return tail_f64(head, &q[np..n], &k[np..n]);
    }
    let mut acc = [[0f32; 16]; 4];
    for i in (0..np).step_by(64) {
        for (j, lanes) in acc.iter_mut().enumerate() {
            for (l, a) in lanes.iter_mut().enumerate() {
                let at = i + j * 16 + l;
                *a = q[at].mul_add(k[at].to_f32(), *a);
            }
        }
    }
    let mut v = [0f32; 16];
    for (l, out) in v.iter_mut().enumerate() {
        *out = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let head = if np > 0 { reduce16(&v) } else { 0.0 };
    tail_f64(head, &q[np..n], &k[np..n])
}

/// The lane tree of `_mm512_reduce_add_ps`: halves, then quarters, then pairs.
pub(super) fn reduce16(v: &[f32; 16]) -> f32 {
    let mut t3 = [0f32; 8];
    for i in 0..8 {
        t3[i] = v[8 + i] + v[i];
    }
    let t6 = [t3[4] + t3[0], t3[5] + t3[1], t3[6] + t3[2], t3[7] + t3[3]];
    (t6[0] + t6[2]) + (t6[1] + t6[3])
}

pub(super) fn tail_f64(head: f32, q: &[f32], k: &[half::f16]) -> f32 {
    if q.is_empty() {
        return head;
    }
    let mut sum = head as f64;
    for (a, b) in q.iter().zip(k) {
        sum += (a * b.to_f32()) as f64;
    }
    sum as f32
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
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
                    let kv =
                        _mm256_cvtph_ps(_mm_loadu_si128(kc.as_ptr().add(h * 8) as *const __m128i));
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

    /// [`super::attend_portable`] for f16 rows whose length is a multiple of 64, in one
    /// function so the per-position products inline instead of being dispatched per call:
    /// the same operations in the same order (the K·Q steps of [`dot_f16_ggml_steps`], the
    /// same `exp`, the rounding `acc * s` and [`mad_f16`] updates), so the same bits.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `q`, `acc`, `out` and every row of `k` and
    /// `v` have the same length, a multiple of 64.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn attend_f16(
        q: &[f32],
        k: &[&[half::f16]],
        v: &[&[half::f16]],
        scale: f32,
        acc: &mut [half::f16],
        out: &mut [f32],
    ) {
        acc.fill(half::f16::ZERO);
        let mut max = f32::NEG_INFINITY;
        let mut sum = 0f32;
        for (kr, vr) in k.iter().zip(v) {
            // SAFETY: the lengths are equal multiples of 64 (the caller's contract).
            let s = unsafe { dot_f16_ggml_steps(q, kr) } * scale;
            let mut ms = 1.0f32;
            let mut vs = 1.0f32;
            if s > max {
                let old = max;
                max = s;
                ms = (old - max).exp();
                // SAFETY: as above; `acc.len()` is a multiple of 8.
                unsafe { scale_f16(acc, ms) };
            } else {
                vs = (s - max).exp();
            }
            // SAFETY: as above.
            unsafe { mad_f16(acc, vr, vs) };
            sum = sum.mul_add(ms, vs);
        }
        let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
        for (o, &a) in out.iter_mut().zip(acc.iter()) {
            *o = a.to_f32() * inv;
        }
    }

    /// `acc[i] = f16(acc[i] * s)`: one rounding to f16, to nearest even, as the scalar path.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `acc.len()` is a multiple of 8.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale_f16(acc: &mut [half::f16], s: f32) {
        let sv = _mm256_set1_ps(s);
        for ac in acc.chunks_exact_mut(8) {
            // SAFETY: each chunk is 8 f16 values (16 bytes) in bounds; unaligned loads and
            // stores are allowed.
            unsafe {
                let a = _mm256_cvtph_ps(_mm_loadu_si128(ac.as_ptr() as *const __m128i));
                let r = _mm256_cvtps_ph(_mm256_mul_ps(a, sv), _MM_FROUND_TO_NEAREST_INT);
                _mm_storeu_si128(ac.as_mut_ptr() as *mut __m128i, r);
            }
        }
    }

    /// [`attend_f16`] with 16-lane registers: ggml's K·Q order is defined on 16-lane
    /// accumulators (the 256-bit path holds each as two halves), and the V updates are
    /// lane-wise, so this is the same arithmetic in half the instructions.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F, BW, DQ and VL, FMA and F16C; lengths as for
    /// [`attend_f16`].
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
    pub unsafe fn attend_f16_wide(
        q: &[f32],
        k: &[&[half::f16]],
        v: &[&[half::f16]],
        scale: f32,
        acc: &mut [half::f16],
        out: &mut [f32],
    ) {
        acc.fill(half::f16::ZERO);
        let mut max = f32::NEG_INFINITY;
        let mut sum = 0f32;
        for (kr, vr) in k.iter().zip(v) {
            let s = dot_wide(q, kr) * scale;
            let mut ms = 1.0f32;
            let mut vs = 1.0f32;
            if s > max {
                let old = max;
                max = s;
                ms = (old - max).exp();
                update_wide(acc, None, ms);
            } else {
                vs = (s - max).exp();
            }
            update_wide(acc, Some(vr), vs);
            sum = sum.mul_add(ms, vs);
        }
        let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
        for (o, &a) in out.iter_mut().zip(acc.iter()) {
            *o = a.to_f32() * inv;
        }
    }

    /// [`dot_f16_ggml_steps`] on 16-lane registers (lengths equal multiples of 64).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
    fn dot_wide(q: &[f32], k: &[half::f16]) -> f32 {
        let mut acc = [_mm512_setzero_ps(); 4];
        for (qc, kc) in q.chunks_exact(64).zip(k.chunks_exact(64)) {
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: 16 elements at offset 16*j lie within the 64-element chunks;
                // unaligned loads are allowed.
                unsafe {
                    let qv = _mm512_loadu_ps(qc.as_ptr().add(j * 16));
                    let kv = _mm512_cvtph_ps(_mm256_loadu_si256(
                        kc.as_ptr().add(j * 16) as *const __m256i
                    ));
                    *a = _mm512_fmadd_ps(qv, kv, *a);
                }
            }
        }
        let v = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm512_extractf32x8_ps(v, 1);
        hsum(_mm256_add_ps(hi, lo))
    }

    /// `acc[i] = f16(fma(v[i], w, acc[i]))` with `v`, or `acc[i] = f16(acc[i] * w)` without:
    /// the scalar path's single rounding per element, 16 lanes at a time.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
    fn update_wide(acc: &mut [half::f16], v: Option<&[half::f16]>, w: f32) {
        let wv = _mm512_set1_ps(w);
        for (c, ac) in acc.chunks_exact_mut(16).enumerate() {
            // SAFETY: each chunk is 16 f16 values (32 bytes) in bounds of `acc` and, at the
            // same offset, of `v` (equal lengths); unaligned loads and stores are allowed.
            unsafe {
                let a = _mm512_cvtph_ps(_mm256_loadu_si256(ac.as_ptr() as *const __m256i));
                let r = match v {
                    Some(v) => {
                        let x = _mm512_cvtph_ps(_mm256_loadu_si256(
                            v.as_ptr().add(c * 16) as *const __m256i
                        ));
                        _mm512_fmadd_ps(x, wv, a)
                    }
                    None => _mm512_mul_ps(a, wv),
                };
                let h = _mm512_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT);
                _mm256_storeu_si256(ac.as_mut_ptr() as *mut __m256i, h);
            }
        }
    }
}
