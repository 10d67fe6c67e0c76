//! The two halves of a LoRA update, `y += s·(B·(A·x))`, in one arithmetic on every path.
//!
//! * `A·x` ([`dot_rows_f32`]): each of A's rows dotted with `x` exactly as
//!   [`super::dot_f32`] does (eight lanes, one reduction order). The AVX2 body runs four
//!   rows at once so the fused multiply-adds are not waiting on one accumulator; each row
//!   keeps its own lanes, so its bits are `dot_f32`'s.
//! * `B·u` ([`add_scaled_combination`]): with B stored transposed (`rank` rows of `n_out`),
//!   output `o` is `t = Σ_j u[j]·Bᵀ[j][o]` by fused multiply-adds in the order
//!   `j = 0, 1, …`, then `y[o] = y[o] + s·t` (a product, then a sum: llama.cpp scales the
//!   update before adding it). The AVX2 body does eight outputs per register in that same
//!   order. A dot product per output would pay a horizontal reduction for every 16-term
//!   sum; this pays none.

/// `out[r] = dot_f32(rows[r], x)` for each of the `out.len()` rows of `rows` (`x.len()`
/// each).
pub fn dot_rows_f32(rows: &[f32], x: &[f32], out: &mut [f32]) {
    let n = x.len();
    debug_assert_eq!(rows.len(), n * out.len());
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx2() {
        // SAFETY: AVX2 and FMA were detected on this CPU (`has_avx2` checks both).
        unsafe { x86::dot_rows_f32_avx2(rows, x, out) };
        return;
    }
    for (o, row) in out.iter_mut().zip(rows.chunks_exact(n.max(1))) {
        *o = super::f32_dot::dot_f32_portable(row, x);
    }
}

/// `y[o] += s · Σ_j u[j]·bt[j·stride + o]` for `o < y.len()` (the sum by fused
/// multiply-adds in `j` order). `bt` holds `u.len()` rows `stride` apart (a block of
/// outputs passes Bᵀ from its first output on, with B's full width as the stride).
///
/// # Panics
/// If `bt` is shorter than `(u.len() - 1) · stride + y.len()`.
pub fn add_scaled_combination(bt: &[f32], stride: usize, u: &[f32], s: f32, y: &mut [f32]) {
    let rank = u.len();
    assert!(rank == 0 || (stride >= y.len() && bt.len() >= (rank - 1) * stride + y.len()));
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx2() {
        // SAFETY: AVX2 and FMA were detected on this CPU (`has_avx2` checks both); the
        // assertion above bounds every read.
        unsafe { x86::add_scaled_combination_avx2(bt, stride, u, s, y) };
        return;
    }
    add_scaled_combination_portable(bt, stride, u, s, y);
}

/// The definition of [`add_scaled_combination`].
pub fn add_scaled_combination_portable(
    bt: &[f32],
    stride: usize,
    u: &[f32],
    s: f32,
    y: &mut [f32],
) {
    for (o, yo) in y.iter_mut().enumerate() {
        let mut t = 0f32;
        for (j, &uj) in u.iter().enumerate() {
            t = uj.mul_add(bt[j * stride + o], t);
        }
        *yo += s * t;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `dot_f32`'s final reduction of eight lanes, then its scalar tail.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn finish(acc: __m256, row: &[f32], x: &[f32], from: usize) -> f32 {
        let t = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let u = _mm_add_ps(t, _mm_movehl_ps(t, t));
        let mut s = _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
        for i in from..x.len() {
            s = row[i].mul_add(x[i], s);
        }
        s
    }

    /// `R` rows' dot products with `x` at once: `R` independent accumulator chains keep
    /// both FMA units busy (one chain waits on its own latency), and each row's chain is
    /// `dot_f32`'s.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn dot_rows_tile<const R: usize>(rows: &[f32], first: usize, x: &[f32], out: &mut [f32]) {
        let n = x.len();
        let chunks = n / 8;
        let mut acc = [_mm256_setzero_ps(); R];
        for i in 0..chunks {
            // SAFETY: `i * 8 + 8 <= n`: within `x`, and within each row `first + k < m`,
            // which the caller keeps inside `rows` (`(first + R) * n <= rows.len()`).
            unsafe {
                let xv = _mm256_loadu_ps(x.as_ptr().add(i * 8));
                for (k, a) in acc.iter_mut().enumerate() {
                    let av = _mm256_loadu_ps(rows.as_ptr().add((first + k) * n + i * 8));
                    *a = _mm256_fmadd_ps(av, xv, *a);
                }
            }
        }
        for (k, a) in acc.into_iter().enumerate() {
            let row = &rows[(first + k) * n..(first + k + 1) * n];
            out[first + k] = finish(a, row, x, chunks * 8);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn dot_rows_f32_avx2(rows: &[f32], x: &[f32], out: &mut [f32]) {
        let n = x.len();
        let m = out.len().min(rows.len() / n.max(1));
        let mut r = 0;
        while r + 8 <= m {
            dot_rows_tile::<8>(rows, r, x, out);
            r += 8;
        }
        while r + 4 <= m {
            dot_rows_tile::<4>(rows, r, x, out);
            r += 4;
        }
        while r < m {
            dot_rows_tile::<1>(rows, r, x, out);
            r += 1;
        }
    }

    /// `B` blocks of eight outputs at once: each output's sum is one chain over `j` in
    /// order (the definition), `B` chains side by side so they do not wait on each other.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn combine_tile<const B: usize>(
        bt: &[f32],
        stride: usize,
        u: &[f32],
        s: f32,
        y: &mut [f32],
        o: usize,
    ) {
        let mut t = [_mm256_setzero_ps(); B];
        for (j, &uj) in u.iter().enumerate() {
            let uv = _mm256_set1_ps(uj);
            for (k, tk) in t.iter_mut().enumerate() {
                // SAFETY: `o + 8 * B <= y.len()` and `j < u.len()`, so the caller's check
                // `bt.len() >= (u.len() - 1) * stride + y.len()` covers these 8 values.
                let bv = unsafe { _mm256_loadu_ps(bt.as_ptr().add(j * stride + o + 8 * k)) };
                *tk = _mm256_fmadd_ps(uv, bv, *tk);
            }
        }
        let sv = _mm256_set1_ps(s);
        for (k, tk) in t.into_iter().enumerate() {
            // SAFETY: `o + 8 * k + 8 <= y.len()`.
            unsafe {
                let at = y.as_mut_ptr().add(o + 8 * k);
                let sum = _mm256_add_ps(_mm256_loadu_ps(at), _mm256_mul_ps(sv, tk));
                _mm256_storeu_ps(at, sum);
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn add_scaled_combination_avx2(
        bt: &[f32],
        stride: usize,
        u: &[f32],
        s: f32,
        y: &mut [f32],
    ) {
        let n_out = y.len();
        let mut o = 0;
        while o + 64 <= n_out {
            combine_tile::<8>(bt, stride, u, s, y, o);
            o += 64;
        }
        while o + 8 <= n_out {
            combine_tile::<1>(bt, stride, u, s, y, o);
            o += 8;
        }
        for (o, yo) in y.iter_mut().enumerate().skip(o) {
            let mut t = 0f32;
            for (j, &uj) in u.iter().enumerate() {
                t = uj.mul_add(bt[j * stride + o], t);
            }
            *yo += s * t;
        }
    }
}
