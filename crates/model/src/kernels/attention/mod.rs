//! The attention arithmetic over the KV cache's element types, in the order of llama.cpp's
//! CPU flash-attention kernel.

#[cfg(target_arch = "x86_64")]
use super::cpu::has_f16c;
use super::dot_f32;

/// Element types of the KV cache, with the operations attention needs. The accumulator of
/// the weighted V sum has the cache's own precision, as in llama.cpp's kernel.
pub trait KvElem: Copy + Send + Sync {
    type Acc: Copy + Default + Send;
    /// The query as the product sees it.
    fn round_query(x: f32) -> f32;
    /// `out[i] = round_query(q[i])`.
    fn round_queries(q: &[f32], out: &mut [f32]) {
        for (o, &x) in out.iter_mut().zip(q) {
            *o = Self::round_query(x);
        }
    }
    /// `Σ q[i] * k[i]`, eight running lanes then a fixed reduction.
    fn dot(q: &[f32], k: &[Self]) -> f32;
    fn acc_clear(acc: &mut [Self::Acc]);
    /// `acc[i] *= s`.
    fn acc_scale(acc: &mut [Self::Acc], s: f32);
    /// `acc[i] = fma(v[i], w, acc[i])`, rounded to the accumulator type.
    fn acc_mad(acc: &mut [Self::Acc], v: &[Self], w: f32);
    /// `out[i] = acc[i] * inv`.
    fn acc_finish(acc: &[Self::Acc], inv: f32, out: &mut [f32]);

    /// Query heads that share their K/V rows, each over its visible positions (`k[j]`,
    /// `v[j]` for each), as llama.cpp's CPU flash-attention kernel computes one head: one
    /// pass in position order with a running maximum, the V sum accumulated in
    /// [`Self::Acc`] with a rounding after every update, normalized at the end. The order
    /// is fixed, so the result does not depend on the batch, nor on how many heads are
    /// computed together.
    fn attend_heads(
        qs: &[&[f32]],
        k: &[&[Self]],
        v: &[&[Self]],
        scale: f32,
        acc: &mut [Self::Acc],
        outs: &mut [&mut [f32]],
    ) {
        for (q, out) in qs.iter().zip(outs.iter_mut()) {
            attend_portable(q, k, v, scale, acc, out);
        }
    }
}

/// One head of [`KvElem::attend_heads`] through the element type's operations, one call per step.
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

/// Keys whose scores and exponentials are computed ahead of their V updates.
const KEY_BLOCK: usize = 32;
// The 512-bit kernel reduces the scores of 16 keys at a time within a block.
const _: () = assert!(KEY_BLOCK.is_multiple_of(16));

/// Query heads attended together by the fused kernels (the rest in further passes).
const MAX_HEADS: usize = 4;

/// llama.cpp's running-maximum bookkeeping for one block of keys, done ahead of the V
/// updates: each key either raises the maximum (the accumulator is rescaled by
/// `exp(old - new)` and the key weighs 1) or weighs `exp(s - max)`. The scores depend only
/// on the query and the key, and the maximum only on the scores, so computing them (and
/// the `exp` calls) first gives the same values as the one-pass loop of
/// [`attend_portable`] while letting the independent products and calls overlap.
#[derive(Clone, Copy)]
struct Plan {
    max: f32,
    sum: f32,
    /// Per key of the current block: `exp` of its argument, and whether it raised the max.
    exp: [f32; KEY_BLOCK],
    raises: [bool; KEY_BLOCK],
}

impl Default for Plan {
    fn default() -> Self {
        Self {
            max: f32::NEG_INFINITY,
            sum: 0.0,
            exp: [0.0; KEY_BLOCK],
            raises: [false; KEY_BLOCK],
        }
    }
}

impl Plan {
    /// Key `j`'s score in the current block (`dot(q, k) * scale`).
    #[inline(always)]
    fn set_score(&mut self, j: usize, score: f32) {
        self.exp[j] = score;
    }

    /// Turns the first `n` scores of the block into weights, in key order.
    #[inline(always)]
    fn settle(&mut self, n: usize) {
        let scores = self.exp;
        self.settle_from(&scores[..n]);
    }

    /// [`Self::settle`] for the scores of the block's first `scores.len()` keys.
    #[inline(always)]
    fn settle_from(&mut self, scores: &[f32]) {
        let n = scores.len();
        // exp(-inf) is +0 in every libm, but the vector `exp` treats -inf as a special
        // input and computes its whole group of 16 with scalar calls: the first key's
        // rescale (from the initial -inf maximum) is set to its known value afterwards.
        let mut from_nothing = None;
        for (i, (&s, (e, r))) in scores
            .iter()
            .zip(self.exp.iter_mut().zip(self.raises.iter_mut()))
            .enumerate()
        {
            *r = s > self.max;
            if *r {
                if self.max == f32::NEG_INFINITY {
                    from_nothing = Some(i);
                    *e = 0.0;
                } else {
                    *e = self.max - s;
                }
                self.max = s;
            } else {
                *e = s - self.max;
            }
        }
        super::libm_expf::expf_in_place(&mut self.exp[..n]);
        if let Some(i) = from_nothing {
            self.exp[i] = 0.0;
        }
    }

    /// `(ms, vs)`: the accumulator's rescale factor and key `j`'s weight.
    #[inline(always)]
    fn weights(&self, j: usize) -> (f32, f32) {
        if self.raises[j] {
            (self.exp[j], 1.0)
        } else {
            (1.0, self.exp[j])
        }
    }

    #[inline(always)]
    fn rescales(&self, j: usize) -> bool {
        self.raises[j]
    }

    #[inline(always)]
    fn add_to_sum(&mut self, ms: f32, vs: f32) {
        self.sum = self.sum.mul_add(ms, vs);
    }

    fn inverse_sum(&self) -> f32 {
        if self.sum == 0.0 {
            0.0
        } else {
            1.0 / self.sum
        }
    }
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

    fn round_queries(q: &[f32], out: &mut [f32]) {
        let n = q.len().min(out.len());
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if has_f16c() {
            // SAFETY: AVX2, FMA and F16C are present (checked); the function stays within
            // the first `n` elements of both slices.
            done = unsafe { x86::round_f16_slice(&q[..n], &mut out[..n]) };
        }
        for (o, &x) in out[done..n].iter_mut().zip(&q[done..n]) {
            *o = Self::round_query(x);
        }
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

    fn attend_heads(
        qs: &[&[f32]],
        k: &[&[half::f16]],
        v: &[&[half::f16]],
        scale: f32,
        acc: &mut [half::f16],
        outs: &mut [&mut [f32]],
    ) {
        #[cfg(target_arch = "x86_64")]
        if let Some(hd) = qs.first().map(|q| q.len()) {
            if has_f16c()
                && matches!(hd, 64 | 128 | 256)
                && qs.len() == outs.len()
                && qs.iter().all(|q| q.len() == hd)
                && outs.iter().all(|o| o.len() == hd)
                // Without an early exit, an OR over all rows (vectorized): called once per
                // query row over every key, the check is a few percent of the kernel.
                && k.iter().chain(v).fold(0, |d, r| d | (r.len() ^ hd)) == 0
            {
                for (qs, outs) in qs.chunks(MAX_HEADS).zip(outs.chunks_mut(MAX_HEADS)) {
                    if super::cpu::features().wide {
                        // SAFETY: AVX-512 F, BW, DQ, VL with F16C and FMA are present
                        // (checked); 1..=MAX_HEADS heads; the lengths are as required
                        // (checked).
                        unsafe { x86::attend_f16_wide(qs, k, v, scale, outs) };
                    } else {
                        // SAFETY: AVX2, FMA and F16C are present (checked); the rest as
                        // above.
                        unsafe { x86::attend_f16(qs, k, v, scale, outs) };
                    }
                }
                return;
            }
        }
        for (q, out) in qs.iter().zip(outs.iter_mut()) {
            attend_portable(q, k, v, scale, acc, out);
        }
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
pub(super) mod x86;
