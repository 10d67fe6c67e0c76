//! Matrix kernels. The work is split across threads by weight row only; each output value
//! is one dot product computed by the same instruction sequence whatever the batch holds
//! (tiles of several tokens run the identical per-token arithmetic side by side), which is
//! what makes greedy output batch-invariant.

use rayon::prelude::*;

use crate::quant::{quantize_row_q8_k, Acts, BlockQ8K};
use crate::weights::{BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1, Matrix, QK};

/// Tokens processed together against one weight row (weights unpacked once per tile).
const TILE: usize = 4;

/// `out[t * rows + r] = dot(W[r], x[t])` for `n` input rows. `x_f32` is used by f32
/// weights, `x_q8` (the same rows quantized with [`crate::weights::quantize_row_q8_1`]) by
/// quantized ones; the caller provides whichever [`Matrix::wants_q8`] asks for.
pub fn matmul(w: &Matrix, x_f32: &[f32], x_q8: &[BlockQ8_1], n: usize, out: &mut [f32]) {
    matmul_group(&[w], x_f32, x_q8, n, &mut [out]);
}

/// Several products of the same input (Q, K and V; gate and up) in one parallel region:
/// one fork-join instead of one per matrix, which matters at decode where each is short.
pub fn matmul_group(
    ws: &[&Matrix],
    x_f32: &[f32],
    x_q8: &[BlockQ8_1],
    n: usize,
    outs: &mut [&mut [f32]],
) {
    assert_eq!(ws.len(), outs.len(), "matmul: one output per matrix");
    for (w, out) in ws.iter().zip(outs.iter()) {
        assert_eq!(out.len(), n * w.rows(), "matmul: output shape");
        if w.wants_q8() {
            assert_eq!(
                x_q8.len(),
                n * w.cols() / QK,
                "matmul: quantized input shape"
            );
        }
        if !w.wants_q8() || w.wants_q8_k() {
            assert_eq!(x_f32.len(), n * w.cols(), "matmul: input shape");
        }
    }
    let threads = rayon::current_num_threads().max(1);
    let total_rows: usize = ws.iter().map(|w| w.rows()).sum();
    let rows_per_task = (total_rows / (threads * 8)).clamp(8, 512);
    // Row-major by weight row, so each task owns a contiguous slice; one token needs no
    // transposition.
    let mut by_row: Vec<Vec<f32>> = ws
        .iter()
        .map(|w| {
            if n == 1 {
                Vec::new()
            } else {
                vec![0f32; n * w.rows()]
            }
        })
        .collect();
    let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
    for (m, (buf, out)) in by_row.iter_mut().zip(outs.iter_mut()).enumerate() {
        let target: &mut [f32] = if n == 1 { out } else { buf };
        for (c, chunk) in target.chunks_mut(rows_per_task * n).enumerate() {
            tasks.push((m, c * rows_per_task, chunk));
        }
    }
    // Only the Q4_1 kernel reads them.
    let scales = if ws.iter().any(|w| matches!(w, Matrix::Q4_1 { .. })) {
        tile_scales(x_q8, n, ws[0].cols() / QK)
    } else {
        Vec::new()
    };
    // The k-quants take the input as Q8_K super-blocks, quantized once for the group.
    let q8_k = match ws.iter().find(|w| w.wants_q8_k()) {
        Some(w) => {
            let cols = w.cols();
            let mut q = vec![BlockQ8K::default(); n * cols / gguf::QK_K];
            for (row, o) in x_f32
                .chunks_exact(cols)
                .zip(q.chunks_exact_mut(cols / gguf::QK_K))
            {
                quantize_row_q8_k(row, o);
            }
            q
        }
        None => Vec::new(),
    };
    let acts = Acts {
        q8_1: x_q8,
        q8_k: &q8_k,
    };
    tasks.into_par_iter().for_each(|(m, r0, chunk)| {
        let nr = chunk.len() / n;
        rows_kernel(ws[m], r0, nr, x_f32, &acts, &scales, n, chunk);
    });
    if n != 1 {
        for ((w, buf), out) in ws.iter().zip(&by_row).zip(outs.iter_mut()) {
            let rows = w.rows();
            for r in 0..rows {
                for t in 0..n {
                    out[t * rows + r] = buf[r * n + t];
                }
            }
        }
    }
}

/// The activation scales of every whole tile, laid out for the kernels:
/// `[tile * nb + block] = [d of its 4 tokens, s of its 4 tokens]`, so a kernel scales four
/// tokens with one vector multiply instead of four scalar ones (same products, same bits).
fn tile_scales(x: &[BlockQ8_1], n: usize, nb: usize) -> Vec<[f32; 2 * TILE]> {
    let tiles = n / TILE;
    let mut out = vec![[0f32; 2 * TILE]; tiles * nb];
    for tile in 0..tiles {
        for i in 0..nb {
            let e = &mut out[tile * nb + i];
            for j in 0..TILE {
                let b = &x[(tile * TILE + j) * nb + i];
                e[j] = b.d;
                e[TILE + j] = b.s;
            }
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn rows_kernel(
    w: &Matrix,
    r0: usize,
    nr: usize,
    x_f32: &[f32],
    acts: &Acts<'_>,
    scales: &[[f32; 2 * TILE]],
    n: usize,
    out: &mut [f32],
) {
    let x_q8 = acts.q8_1;
    let cols = w.cols();
    let nb = cols / QK;
    match w {
        Matrix::F32 { data, .. } => {
            for r in 0..nr {
                let wr = &data[(r0 + r) * cols..(r0 + r + 1) * cols];
                for t in 0..n {
                    out[r * n + t] = dot_f32(wr, &x_f32[t * cols..(t + 1) * cols]);
                }
            }
        }
        Matrix::Q4_0 { data, .. } => tiled(nr, n, nb, x_q8, out, |r, acts, _, res| {
            dot_q4_0(&data[(r0 + r) * nb..(r0 + r + 1) * nb], acts, res)
        }),
        Matrix::Q4_1 { data, .. } => tiled(nr, n, nb, x_q8, out, |r, acts, tile, res| {
            let sc = tile.and_then(|k| scales.get(k * nb..(k + 1) * nb));
            dot_q4_1(&data[(r0 + r) * nb..(r0 + r + 1) * nb], acts, sc, res)
        }),
        Matrix::Q8_0 { data, .. } => tiled(nr, n, nb, x_q8, out, |r, acts, _, res| {
            dot_q8_0(&data[(r0 + r) * nb..(r0 + r + 1) * nb], acts, res)
        }),
        Matrix::Blocks(m) => m.rows_kernel(r0, nr, acts, n, out),
    }
}

/// Runs `dot(row, tile of up to TILE activation rows)` over all rows and tokens.
fn tiled(
    nr: usize,
    n: usize,
    nb: usize,
    x: &[BlockQ8_1],
    out: &mut [f32],
    dot: impl Fn(usize, &[&[BlockQ8_1]], Option<usize>, &mut [f32]),
) {
    let mut acts: [&[BlockQ8_1]; TILE] = [&[]; TILE];
    let mut res = [0f32; TILE];
    for r in 0..nr {
        let mut t = 0;
        while t < n {
            let k = (n - t).min(TILE);
            for (j, a) in acts.iter_mut().enumerate().take(k) {
                *a = &x[(t + j) * nb..(t + j + 1) * nb];
            }
            // Whole tiles start at multiples of TILE, so their index is t / TILE.
            let tile = (k == TILE).then_some(t / TILE);
            dot(r, &acts[..k], tile, &mut res[..k]);
            out[r * n + t..r * n + t + k].copy_from_slice(&res[..k]);
            t += k;
        }
    }
}

/// f32 dot product with eight independent accumulators, reduced in the same order as the
/// SIMD kernels (a fixed order, so deterministic).
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        for j in 0..8 {
            acc[j] = a[i * 8 + j].mul_add(b[i * 8 + j], acc[j]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for i in chunks * 8..a.len() {
        s = a[i].mul_add(b[i], s);
    }
    s
}

/// `exp(x)` as ggml's vectorized SwiGLU computes it (its AVX-512 polynomial, which is what
/// llama.cpp runs on the reference machines), evaluated lane by lane. Within 1.5 ulp of the
/// true value; matching it exactly keeps our activations on llama.cpp's side of every
/// quantization boundary.
pub fn ggml_expf(x: f32) -> f32 {
    let r = f32::from_bits(0x4B40_0000); // 0x1.8p23
    let z = x.mul_add(f32::from_bits(0x3FB8_AA3B), r); // log2(e)
    let n = z - r;
    let b = (-n).mul_add(
        f32::from_bits(0x35BF_BE8E),
        (-n).mul_add(f32::from_bits(0x3F31_7200), x),
    );
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let u = b * b;
    let j = f32::from_bits(0x3C07_2010)
        .mul_add(b, f32::from_bits(0x3D2B_9F17))
        .mul_add(
            u,
            f32::from_bits(0x3E2A_AF33).mul_add(b, f32::from_bits(0x3EFF_FEDB)),
        )
        .mul_add(u, f32::from_bits(0x3F7F_FFF6).mul_add(b, 1.0));
    // scalef(j, n): one rounding of j * 2^n, exact in f64 before it (|n| <= 192 here).
    (j as f64 * f64::from_bits(((n as i64 + 1023) as u64) << 52)) as f32
}

/// `gate[i] = silu(gate[i]) * up[i]`, ggml's SwiGLU, vectorized where the CPU allows with
/// the same operations lane by lane as [`silu`] (so the same bits).
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA are present (checked); the function reads and writes only
        // within the first `n` elements of both slices.
        done = unsafe { x86::swiglu(&mut gate[..n], &up[..n]) };
    }
    for (g, u) in gate[done..n].iter_mut().zip(&up[done..n]) {
        *g = silu(*g) * u;
    }
}

/// SiLU as ggml's SwiGLU computes it: `x / (1 + exp(-x))` with [`ggml_expf`].
pub fn silu(x: f32) -> f32 {
    x / (1.0 + ggml_expf(-x))
}

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
fn reduce16(v: &[f32; 16]) -> f32 {
    let mut t3 = [0f32; 8];
    for i in 0..8 {
        t3[i] = v[8 + i] + v[i];
    }
    let t6 = [t3[4] + t3[0], t3[5] + t3[1], t3[6] + t3[2], t3[7] + t3[3]];
    (t6[0] + t6[2]) + (t6[1] + t6[3])
}

fn tail_f64(head: f32, q: &[f32], k: &[half::f16]) -> f32 {
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
fn has_f16c() -> bool {
    has_avx2() && std::arch::is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

#[cfg(target_arch = "x86_64")]
fn has_vnni() -> bool {
    has_avx2()
        && std::arch::is_x86_feature_detected!("avx512vnni")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

macro_rules! dispatch {
    ($name:ident, $wt:ty, $scalar:path, $simd:ident) => {
        /// One weight row against a tile of activation rows.
        pub fn $name(w: &[$wt], acts: &[&[BlockQ8_1]], out: &mut [f32]) {
            #[cfg(target_arch = "x86_64")]
            if has_vnni() {
                // SAFETY: the CPU supports AVX2, FMA, AVX-512 VNNI and VL (checked just
                // above), the only requirement of the target-feature function; slice bounds
                // are checked inside it.
                unsafe { x86::vnni::$simd(w, acts, out) };
                return;
            }
            #[cfg(target_arch = "x86_64")]
            if has_avx2() {
                // SAFETY: the CPU supports AVX2 and FMA (checked just above), the only
                // requirement of the target-feature function; slice bounds are checked
                // inside it.
                unsafe { x86::avx2::$simd(w, acts, out) };
                return;
            }
            for (a, o) in acts.iter().zip(out.iter_mut()) {
                *o = $scalar(w, a);
            }
        }
    };
}

/// One Q4_1 weight row against a tile of activation rows; `scales` are the tile's
/// [`tile_scales`] when it is a whole tile.
pub fn dot_q4_1(
    w: &[BlockQ4_1],
    acts: &[&[BlockQ8_1]],
    scales: Option<&[[f32; 2 * TILE]]>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if has_vnni() {
        // SAFETY: the CPU supports AVX2, FMA, AVX-512 VNNI and VL (checked just above), the
        // only requirement of the target-feature function; slice bounds are checked inside.
        unsafe { x86::vnni::q4_1(w, acts, scales, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above), the only requirement
        // of the target-feature function; slice bounds are checked inside.
        unsafe { x86::avx2::q4_1(w, acts, scales, out) };
        return;
    }
    let _ = scales;
    for (a, o) in acts.iter().zip(out.iter_mut()) {
        *o = scalar::q4_1(w, a);
    }
}
dispatch!(dot_q4_0, BlockQ4_0, scalar::q4_0, q4_0);
dispatch!(dot_q8_0, BlockQ8_0, scalar::q8_0, q8_0);

/// Portable reference kernels: the definition the SIMD kernels are tested against.
pub mod scalar {
    use super::*;

    pub fn q4_1(w: &[BlockQ4_1], a: &[BlockQ8_1]) -> f32 {
        let mut acc = 0f32;
        let mut summs = 0f32;
        for (wb, ab) in w.iter().zip(a) {
            let mut isum = 0i32;
            for j in 0..16 {
                isum += (wb.qs[j] & 15) as i32 * ab.qs[j] as i32;
                isum += (wb.qs[j] >> 4) as i32 * ab.qs[j + 16] as i32;
            }
            acc += wb.d * ab.d * isum as f32;
            summs += wb.m * ab.s;
        }
        acc + summs
    }

    pub fn q4_0(w: &[BlockQ4_0], a: &[BlockQ8_1]) -> f32 {
        let mut acc = 0f32;
        for (wb, ab) in w.iter().zip(a) {
            let mut isum = 0i32;
            for j in 0..16 {
                isum += ((wb.qs[j] & 15) as i32 - 8) * ab.qs[j] as i32;
                isum += ((wb.qs[j] >> 4) as i32 - 8) * ab.qs[j + 16] as i32;
            }
            acc += wb.d * ab.d * isum as f32;
        }
        acc
    }

    pub fn q8_0(w: &[BlockQ8_0], a: &[BlockQ8_1]) -> f32 {
        let mut acc = 0f32;
        for (wb, ab) in w.iter().zip(a) {
            let isum: i32 = wb
                .qs
                .iter()
                .zip(&ab.qs)
                .map(|(&x, &y)| x as i32 * y as i32)
                .sum();
            acc += wb.d * ab.d * isum as f32;
        }
        acc
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::weights::BlockQ8_1;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn load_act(a: &BlockQ8_1) -> __m256i {
        // SAFETY: `qs` is 32 readable bytes; `loadu` has no alignment requirement.
        unsafe { _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i) }
    }

    /// The 32 nibbles of a 4-bit block as bytes, in element order (low nibbles are elements
    /// 0..16, high nibbles 16..32).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn unpack_nibbles(qs: &[u8; 16]) -> __m256i {
        // SAFETY: `qs` is 16 readable bytes; `loadu` has no alignment requirement.
        let q = unsafe { _mm_loadu_si128(qs.as_ptr() as *const __m128i) };
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(q, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
        _mm256_set_m128i(hi, lo)
    }

    /// [`super::swiglu`] over whole 8-lane groups; returns how many elements it did (it
    /// stops at a group whose exponent needs the f64 path of [`super::ggml_expf`]).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `gate.len() == up.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn swiglu(gate: &mut [f32], up: &[f32]) -> usize {
        let c = |bits: u32| _mm256_set1_ps(f32::from_bits(bits));
        let r = c(0x4B40_0000);
        let mut done = 0;
        for (gc, uc) in gate.chunks_exact_mut(8).zip(up.chunks_exact(8)) {
            // SAFETY: each chunk has 8 elements; unaligned loads and stores are allowed.
            let (x, u) = unsafe { (_mm256_loadu_ps(gc.as_ptr()), _mm256_loadu_ps(uc.as_ptr())) };
            let neg = _mm256_sub_ps(_mm256_setzero_ps(), x);
            let z = _mm256_fmadd_ps(neg, c(0x3FB8_AA3B), r);
            let n = _mm256_sub_ps(z, r);
            // Results below 2^-126 or above 2^127 take the scalar path.
            let big = _mm256_cmp_ps(
                _mm256_andnot_ps(_mm256_set1_ps(-0.0), n),
                _mm256_set1_ps(126.0),
                _CMP_GT_OQ,
            );
            if _mm256_movemask_ps(big) != 0 {
                break;
            }
            let b = _mm256_fnmadd_ps(n, c(0x35BF_BE8E), _mm256_fnmadd_ps(n, c(0x3F31_7200), neg));
            let uu = _mm256_mul_ps(b, b);
            let j = _mm256_fmadd_ps(
                _mm256_fmadd_ps(
                    _mm256_fmadd_ps(c(0x3C07_2010), b, c(0x3D2B_9F17)),
                    uu,
                    _mm256_fmadd_ps(c(0x3E2A_AF33), b, c(0x3EFF_FEDB)),
                ),
                uu,
                _mm256_fmadd_ps(c(0x3F7F_FFF6), b, _mm256_set1_ps(1.0)),
            );
            // 2^n as an f32 (|n| <= 126, so normal), then one rounding of j * 2^n.
            let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                23,
            ));
            let e = _mm256_mul_ps(j, pow2);
            let silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e));
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(gc.as_mut_ptr(), _mm256_mul_ps(silu, u)) };
            done += 8;
        }
        done
    }

    /// [`super::dot_f16_ggml`] over whole 64-element steps, 16-lane accumulators held as
    /// pairs of 8-lane halves; the final cross-lane tree is `hsum` of `hi + lo`.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `q.len() == k.len()`, a multiple of 64.
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

    /// The quantized dot-product kernels, compiled once per instruction set. Only the
    /// byte-product step differs (`maddubs` + `madd` on AVX2, one `dpbusd` with VNNI); both
    /// give the same exact i32 sums, so the two builds agree bit for bit.
    macro_rules! quant_kernels {
        ($module:ident, $features:literal, $doc:literal) => {
            #[doc = $doc]
            pub mod $module {
                use std::arch::x86_64::*;

                use super::{hsum, load_act, unpack_nibbles};
                use crate::weights::{BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1};

                /// Sums of products of 32 unsigned bytes (0..=128) with 32 signed bytes, as
                /// 8 i32 lanes converted to f32. `maddubs` cannot saturate here:
                /// 2 * 128 * 127 < 32767.
                #[inline]
                #[target_feature(enable = $features)]
                fn dot_u8_i8(u: __m256i, s: __m256i) -> __m256 {
                    quant_kernels!(@dot $module, u, s)
                }

                /// A tile of `N` activation rows against one weight row, unrolled for `N`.
                #[inline]
                #[target_feature(enable = $features)]
                fn q4_1_n<const N: usize>(w: &[BlockQ4_1], acts: [&[BlockQ8_1]; N], out: &mut [f32]) {
                    let mut acc = [_mm256_setzero_ps(); N];
                    let mut summs = [0f32; N];
                    for (i, wb) in w.iter().enumerate() {
                        let wq = unpack_nibbles(&wb.qs);
                        for t in 0..N {
                            let ab = &acts[t][i];
                            summs[t] += wb.m * ab.s;
                            let xy = dot_u8_i8(wq, load_act(ab));
                            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(wb.d * ab.d), xy, acc[t]);
                        }
                    }
                    for t in 0..N {
                        out[t] = hsum(acc[t]) + summs[t];
                    }
                }

                #[inline]
                #[target_feature(enable = $features)]
                fn q4_0_n<const N: usize>(w: &[BlockQ4_0], acts: [&[BlockQ8_1]; N], out: &mut [f32]) {
                    let mut acc = [_mm256_setzero_ps(); N];
                    let eight = _mm256_set1_epi8(8);
                    for (i, wb) in w.iter().enumerate() {
                        let wq = _mm256_sub_epi8(unpack_nibbles(&wb.qs), eight);
                        let wabs = _mm256_sign_epi8(wq, wq);
                        for t in 0..N {
                            let ab = &acts[t][i];
                            let xy = dot_u8_i8(wabs, _mm256_sign_epi8(load_act(ab), wq));
                            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(wb.d * ab.d), xy, acc[t]);
                        }
                    }
                    for t in 0..N {
                        out[t] = hsum(acc[t]);
                    }
                }

                #[inline]
                #[target_feature(enable = $features)]
                fn q8_0_n<const N: usize>(w: &[BlockQ8_0], acts: [&[BlockQ8_1]; N], out: &mut [f32]) {
                    let mut acc = [_mm256_setzero_ps(); N];
                    for (i, wb) in w.iter().enumerate() {
                        // SAFETY: `qs` is 32 readable bytes; `loadu` has no alignment
                        // requirement.
                        let wq = unsafe { _mm256_loadu_si256(wb.qs.as_ptr() as *const __m256i) };
                        let wabs = _mm256_sign_epi8(wq, wq);
                        for t in 0..N {
                            let ab = &acts[t][i];
                            let xy = dot_u8_i8(wabs, _mm256_sign_epi8(load_act(ab), wq));
                            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(wb.d * ab.d), xy, acc[t]);
                        }
                    }
                    for t in 0..N {
                        out[t] = hsum(acc[t]);
                    }
                }

                /// A whole tile of 4 with its scales gathered ([`super::super::tile_scales`]):
                /// the four `d_w * d_a` and `m_w * s_a` products are one vector multiply
                /// each, lane for lane the scalar products of [`q4_1_n`].
                #[inline]
                #[target_feature(enable = $features)]
                fn q4_1_scaled(w: &[BlockQ4_1], acts: [&[BlockQ8_1]; 4], scales: &[[f32; 8]], out: &mut [f32]) {
                    let mut acc = [_mm256_setzero_ps(); 4];
                    let mut summs = _mm_setzero_ps();
                    let lane = [
                        _mm256_set1_epi32(0),
                        _mm256_set1_epi32(1),
                        _mm256_set1_epi32(2),
                        _mm256_set1_epi32(3),
                    ];
                    for ((i, wb), sc) in w.iter().enumerate().zip(scales) {
                        // SAFETY: `sc` is 8 readable f32; unaligned loads are allowed.
                        let (dv, sv) = unsafe { (_mm_loadu_ps(sc.as_ptr()), _mm_loadu_ps(sc.as_ptr().add(4))) };
                        summs = _mm_add_ps(summs, _mm_mul_ps(_mm_set1_ps(wb.m), sv));
                        let dd = _mm_mul_ps(_mm_set1_ps(wb.d), dv);
                        let dd = _mm256_set_m128(dd, dd);
                        let wq = unpack_nibbles(&wb.qs);
                        for t in 0..4 {
                            let xy = dot_u8_i8(wq, load_act(&acts[t][i]));
                            acc[t] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(dd, lane[t]), xy, acc[t]);
                        }
                    }
                    let mut s = [0f32; 4];
                    // SAFETY: `s` is 4 writable f32.
                    unsafe { _mm_storeu_ps(s.as_mut_ptr(), summs) };
                    for t in 0..4 {
                        out[t] = hsum(acc[t]) + s[t];
                    }
                }

                /// # Safety
                /// The CPU must support the features this module is compiled for.
                #[target_feature(enable = $features)]
                pub unsafe fn q4_1(w: &[BlockQ4_1], acts: &[&[BlockQ8_1]], scales: Option<&[[f32; 8]]>, out: &mut [f32]) {
                    match (acts, scales) {
                        (&[a, b, c, d], Some(sc)) if sc.len() == w.len() => q4_1_scaled(w, [a, b, c, d], sc, out),
                        // SAFETY: same features as this function, the only requirement.
                        _ => unsafe { q4_1_tile(w, acts, out) },
                    }
                }

                quant_kernels!(@entry q4_1_tile, q4_1_n, BlockQ4_1, $features);
                quant_kernels!(@entry q4_0, q4_0_n, BlockQ4_0, $features);
                quant_kernels!(@entry q8_0, q8_0_n, BlockQ8_0, $features);
            }
        };
        // The public entry: the tile's size picks a fully unrolled instance.
        (@entry $name:ident, $tile:ident, $wt:ty, $features:literal) => {
            /// # Safety
            /// The CPU must support the features this module is compiled for.
            #[target_feature(enable = $features)]
            pub unsafe fn $name(w: &[$wt], acts: &[&[BlockQ8_1]], out: &mut [f32]) {
                match *acts {
                    [a, b, c, d, ..] => $tile::<4>(w, [a, b, c, d], out),
                    [a, b, c] => $tile::<3>(w, [a, b, c], out),
                    [a, b] => $tile::<2>(w, [a, b], out),
                    [a] => $tile::<1>(w, [a], out),
                    [] => {}
                }
            }
        };
        (@dot avx2, $u:ident, $s:ident) => {{
            let p16 = _mm256_maddubs_epi16($u, $s);
            _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)))
        }};
        (@dot vnni, $u:ident, $s:ident) => {
            _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), $u, $s))
        };
    }

    quant_kernels!(avx2, "avx2,fma", "Kernels for AVX2 with FMA.");
    quant_kernels!(
        vnni,
        "avx2,fma,avx512vnni,avx512vl",
        "Kernels for CPUs with AVX-512 VNNI (Zen 4, Sapphire Rapids and later)."
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::quantize_row_q8_1;
    use gguf::GgmlType;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    fn matrix(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> (Matrix, Vec<f32>) {
        let mut s = seed;
        let vals: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s)).collect();
        let mut w = gguf::GgufWriter::new();
        w.tensor_f32("w", &[cols as u64, rows as u64], ty, &vals);
        let f = gguf::GgufFile::parse(w.to_bytes()).unwrap();
        let info = f.tensor("w").unwrap();
        let deq = f.tensor_f32(info);
        (Matrix::load(&f, info, rows, cols).unwrap(), deq)
    }

    /// Each kernel (SIMD where the CPU has it) against the plain f32 product of the
    /// dequantized weights and the dequantized activations, and the SIMD tile against the
    /// scalar reference: activation quantization is the only approximation.
    #[test]
    fn kernels_match_reference_for_every_type_and_tile() {
        let (rows, cols, n) = (19, 96, 7);
        let mut s = 99u64;
        let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s) * 3.0).collect();
        let mut xq = vec![BlockQ8_1::default(); n * cols / QK];
        for t in 0..n {
            quantize_row_q8_1(
                &x[t * cols..(t + 1) * cols],
                &mut xq[t * cols / QK..(t + 1) * cols / QK],
            );
        }
        let xdq: Vec<f32> = xq
            .iter()
            .flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d))
            .collect();
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::F32,
        ] {
            let (m, deq) = matrix(ty, rows, cols, 7);
            let mut out = vec![0f32; n * rows];
            matmul(&m, &x, &xq, n, &mut out);
            for t in 0..n {
                let xin = if ty == GgmlType::F32 { &x } else { &xdq };
                for r in 0..rows {
                    let want: f32 = (0..cols)
                        .map(|c| deq[r * cols + c] * xin[t * cols + c])
                        .sum();
                    let got = out[t * rows + r];
                    // Q4_1's offset term uses ggml's f16-rounded activation sum `s`.
                    let tol = if ty == GgmlType::Q4_1 { 2e-2 } else { 2e-3 };
                    assert!(
                        (want - got).abs() < tol * (1.0 + want.abs()),
                        "{ty:?} t{t} r{r}: {want} vs {got}"
                    );
                    // The dispatched (SIMD) tile against the portable definition.
                    let nb = cols / QK;
                    let a = &xq[t * nb..(t + 1) * nb];
                    let scalar = match &m {
                        Matrix::Q4_0 { data, .. } => scalar::q4_0(&data[r * nb..(r + 1) * nb], a),
                        Matrix::Q4_1 { data, .. } => scalar::q4_1(&data[r * nb..(r + 1) * nb], a),
                        Matrix::Q8_0 { data, .. } => scalar::q8_0(&data[r * nb..(r + 1) * nb], a),
                        Matrix::F32 { .. } | Matrix::Blocks(_) => got,
                    };
                    assert!(
                        (scalar - got).abs() <= 1e-5 * (1.0 + got.abs()),
                        "{ty:?} t{t} r{r}: SIMD {got} vs scalar {scalar}"
                    );
                }
            }
        }
    }

    /// The SIMD attention kernels agree bit for bit with the scalar definitions (which
    /// mirror ggml's order), for lengths with and without a partial 64-element step.
    #[test]
    fn f16_attention_kernels_match_scalar_bit_for_bit() {
        use half::f16;
        let mut s = 11u64;
        for n in [64usize, 128, 72, 32, 8] {
            let q: Vec<f32> = (0..n)
                .map(|_| f16::from_f32(lcg(&mut s)).to_f32())
                .collect();
            let k: Vec<f16> = (0..n).map(|_| f16::from_f32(lcg(&mut s) * 4.0)).collect();
            let got = dot_f16_ggml(&q, &k);
            // The scalar definition, written out.
            let np = n & !63;
            let mut acc = [[0f32; 16]; 4];
            for i in (0..np).step_by(64) {
                for (j, lanes) in acc.iter_mut().enumerate() {
                    for (l, a) in lanes.iter_mut().enumerate() {
                        *a = q[i + j * 16 + l].mul_add(k[i + j * 16 + l].to_f32(), *a);
                    }
                }
            }
            let mut v = [0f32; 16];
            for (l, o) in v.iter_mut().enumerate() {
                *o = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
            }
            let head = if np > 0 { reduce16(&v) } else { 0.0 };
            assert_eq!(
                got.to_bits(),
                tail_f64(head, &q[np..], &k[np..]).to_bits(),
                "n={n}"
            );
            let exact: f64 = q
                .iter()
                .zip(&k)
                .map(|(a, b)| *a as f64 * b.to_f32() as f64)
                .sum();
            assert!(
                (got as f64 - exact).abs() < 1e-4 * (1.0 + exact.abs()),
                "n={n}: {got} vs {exact}"
            );

            let mut acc_simd: Vec<f16> = (0..n).map(|_| f16::from_f32(lcg(&mut s))).collect();
            let mut acc_scalar = acc_simd.clone();
            let w = lcg(&mut s);
            <f16 as KvElem>::acc_mad(&mut acc_simd, &k, w);
            for (a, x) in acc_scalar.iter_mut().zip(&k) {
                *a = f16::from_f32(x.to_f32().mul_add(w, a.to_f32()));
            }
            assert_eq!(acc_simd, acc_scalar, "n={n}");
        }
    }

    /// Both instruction-set builds of the quantized kernels give identical bits.
    ///
    /// It needs a CPU with AVX-512 VNNI, which not every machine has, and a test cannot
    /// report "skipped" at run time: so it is ignored by default, `scripts/test.sh` runs it
    /// (`--ignored`) where the CPU has VNNI and says that it did not run where not, and run
    /// by hand on a CPU without VNNI it fails rather than pass without checking anything.
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore = "needs AVX-512 VNNI; scripts/test.sh runs it where the CPU has it"]
    fn avx2_and_vnni_kernels_agree_bit_for_bit() {
        assert!(
            has_vnni(),
            "this CPU lacks AVX-512 VNNI: the VNNI kernels cannot run here, so this test checks nothing"
        );
        let cols = 128;
        let nb = cols / QK;
        let mut s = 3u64;
        let x: Vec<f32> = (0..TILE * cols).map(|_| lcg(&mut s) * 2.0).collect();
        let mut xq = vec![BlockQ8_1::default(); TILE * nb];
        for t in 0..TILE {
            quantize_row_q8_1(&x[t * cols..(t + 1) * cols], &mut xq[t * nb..(t + 1) * nb]);
        }
        let acts: Vec<&[BlockQ8_1]> = xq.chunks(nb).collect();
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let (m, _) = matrix(ty, 3, cols, 5);
            for r in 0..3 {
                let (mut a, mut b) = ([0f32; TILE], [0f32; TILE]);
                // SAFETY: AVX2, FMA, AVX-512 VNNI and VL are present (checked above).
                unsafe {
                    match &m {
                        Matrix::Q4_0 { data, .. } => {
                            x86::avx2::q4_0(&data[r * nb..(r + 1) * nb], &acts, &mut a);
                            x86::vnni::q4_0(&data[r * nb..(r + 1) * nb], &acts, &mut b);
                        }
                        Matrix::Q4_1 { data, .. } => {
                            x86::avx2::q4_1(&data[r * nb..(r + 1) * nb], &acts, None, &mut a);
                            x86::vnni::q4_1(&data[r * nb..(r + 1) * nb], &acts, None, &mut b);
                        }
                        Matrix::Q8_0 { data, .. } => {
                            x86::avx2::q8_0(&data[r * nb..(r + 1) * nb], &acts, &mut a);
                            x86::vnni::q8_0(&data[r * nb..(r + 1) * nb], &acts, &mut b);
                        }
                        Matrix::F32 { .. } | Matrix::Blocks(_) => unreachable!(),
                    }
                }
                assert_eq!(a.map(f32::to_bits), b.map(f32::to_bits), "{ty:?} row {r}");
                if let Matrix::Q4_1 { data, .. } = &m {
                    // The tile with gathered scales gives the same bits as without.
                    let scales = tile_scales(&xq, TILE, nb);
                    let mut c = [0f32; TILE];
                    let mut d = [0f32; TILE];
                    // SAFETY: as above.
                    unsafe {
                        x86::avx2::q4_1(&data[r * nb..(r + 1) * nb], &acts, Some(&scales), &mut c);
                        x86::vnni::q4_1(&data[r * nb..(r + 1) * nb], &acts, Some(&scales), &mut d);
                    }
                    assert_eq!(
                        a.map(f32::to_bits),
                        c.map(f32::to_bits),
                        "scaled avx2 row {r}"
                    );
                    assert_eq!(
                        a.map(f32::to_bits),
                        d.map(f32::to_bits),
                        "scaled vnni row {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn ggml_expf_is_accurate_and_saturates() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = ggml_expf(x) as f64;
            assert!(
                (got - want).abs() <= 4e-7 * want,
                "exp({x}): {got} vs {want}"
            );
            x += 0.173;
        }
        assert_eq!(ggml_expf(-200.0), 0.0);
        assert_eq!(ggml_expf(200.0), f32::INFINITY);
        assert!((silu(2.0) - 2.0 / (1.0 + (-2.0f32).exp())).abs() < 1e-6);
        // The vectorized SwiGLU gives the scalar definition's bits, including lanes that
        // fall back to the scalar path.
        let mut s = 17u64;
        let mut gate: Vec<f32> = (0..203).map(|_| lcg(&mut s) * 30.0).collect();
        gate[50] = 150.0;
        gate[77] = -150.0;
        let up: Vec<f32> = (0..203).map(|_| lcg(&mut s)).collect();
        let want: Vec<u32> = gate
            .iter()
            .zip(&up)
            .map(|(g, u)| (silu(*g) * u).to_bits())
            .collect();
        swiglu(&mut gate, &up);
        assert_eq!(gate.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want);
    }

    #[test]
    fn matmul_rows_do_not_depend_on_batch() {
        let (rows, cols) = (37, 64);
        let (m, _) = matrix(GgmlType::Q4_1, rows, cols, 3);
        let mut s = 5u64;
        let n = 9;
        let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s)).collect();
        let mut xq = vec![BlockQ8_1::default(); n * cols / QK];
        for t in 0..n {
            quantize_row_q8_1(
                &x[t * cols..(t + 1) * cols],
                &mut xq[t * cols / QK..(t + 1) * cols / QK],
            );
        }
        let mut all = vec![0f32; n * rows];
        matmul(&m, &x, &xq, n, &mut all);
        for t in 0..n {
            let mut one = vec![0f32; rows];
            let nb = cols / QK;
            matmul(
                &m,
                &x[t * cols..(t + 1) * cols],
                &xq[t * nb..(t + 1) * nb],
                1,
                &mut one,
            );
            assert_eq!(
                one,
                all[t * rows..(t + 1) * rows],
                "token {t} differs alone vs batched"
            );
        }
    }
}
