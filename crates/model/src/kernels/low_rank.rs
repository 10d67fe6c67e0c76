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

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn dot_rows_f32_avx2(rows: &[f32], x: &[f32], out: &mut [f32]) {
        let n = x.len();
        let chunks = n / 8;
        let m = out.len().min(rows.len() / n.max(1));
        let mut r = 0;
        while r + 4 <= m {
            let base = [r * n, (r + 1) * n, (r + 2) * n, (r + 3) * n];
            let mut acc = [_mm256_setzero_ps(); 4];
            for i in 0..chunks {
                // SAFETY: `i * 8 + 8 <= n`: within `x`, and within each of the four rows,
                // which lie inside `rows` (`(r + 3) * n + n <= m * n <= rows.len()`).
                unsafe {
                    let xv = _mm256_loadu_ps(x.as_ptr().add(i * 8));
                    for k in 0..4 {
                        let av = _mm256_loadu_ps(rows.as_ptr().add(base[k] + i * 8));
                        acc[k] = _mm256_fmadd_ps(av, xv, acc[k]);
                    }
                }
            }
            for k in 0..4 {
                let row = &rows[base[k]..base[k] + n];
                out[r + k] = finish(acc[k], row, x, chunks * 8);
            }
            r += 4;
        }
        while r < m {
            let row = &rows[r * n..(r + 1) * n];
            let mut acc = _mm256_setzero_ps();
            for i in 0..chunks {
                // SAFETY: `i * 8 + 8 <= n`, within `row` and `x`.
                unsafe {
                    let av = _mm256_loadu_ps(row.as_ptr().add(i * 8));
                    let xv = _mm256_loadu_ps(x.as_ptr().add(i * 8));
                    acc = _mm256_fmadd_ps(av, xv, acc);
                }
            }
            out[r] = finish(acc, row, x, chunks * 8);
            r += 1;
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
        let blocks = n_out / 8;
        let sv = _mm256_set1_ps(s);
        for b in 0..blocks {
            let o = b * 8;
            let mut t = _mm256_setzero_ps();
            for (j, &uj) in u.iter().enumerate() {
                // SAFETY: `o + 8 <= n_out` and `j < u.len()`, so the caller's check
                // `bt.len() >= (u.len() - 1) * stride + n_out` covers these 8 values.
                let bv = unsafe { _mm256_loadu_ps(bt.as_ptr().add(j * stride + o)) };
                t = _mm256_fmadd_ps(_mm256_set1_ps(uj), bv, t);
            }
            // SAFETY: `o + 8 <= n_out = y.len()`.
            unsafe {
                let yv = _mm256_loadu_ps(y.as_ptr().add(o));
                let sum = _mm256_add_ps(yv, _mm256_mul_ps(sv, t));
                _mm256_storeu_ps(y.as_mut_ptr().add(o), sum);
            }
        }
        for (o, yo) in y.iter_mut().enumerate().skip(blocks * 8) {
            let mut t = 0f32;
            for (j, &uj) in u.iter().enumerate() {
                t = uj.mul_add(bt[j * stride + o], t);
            }
            *yo += s * t;
        }
    }
}
