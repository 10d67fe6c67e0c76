//! The products of Q4_1 (its scale and minimum widened at load): the run-time choice of
//! instruction set (512-bit tiles, VNNI, AVX2, portable) for a whole product, a row or a
//! tile, and the portable reference every SIMD build is tested against.

#[cfg(target_arch = "x86_64")]
use super::cpu::{has_avx2, has_vnni, wide_available};
#[cfg(target_arch = "x86_64")]
use super::{x86, x86_512};
use crate::blocks::{BlockQ4_1, BlockQ8_1, TileScales, TILE};

/// Q4_1's rows of `w` (`nb` blocks each) against the `n` tokens of `x`, `out[r * n + t]`:
/// the 512-bit tiles where the CPU has them and there is a tile of tokens, else the 256-bit
/// kernel, which takes the tiles' gathered scales, or the portable rows.
pub fn q4_1_product(
    w: &[BlockQ4_1],
    nb: usize,
    x: &[BlockQ8_1],
    scales: &[TileScales],
    n: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if n >= TILE && wide_available() {
        // SAFETY: the CPU has the features `wide_available` checks, the function's only
        // requirement; it bounds-checks its slices.
        unsafe { x86_512::q4_1_rows(w, nb, x, n, out) };
        return;
    }
    rows_q4_1(w, nb, x, scales, n, out);
}

/// Q4_1's rows straight into token-major `out[t * ld + r]`, where the CPU has the 512-bit
/// tiles and `n` is whole tiles; false (nothing done) where not.
pub fn q4_1_token_major(
    w: &[BlockQ4_1],
    nb: usize,
    x: &[BlockQ8_1],
    n: usize,
    out: &mut [f32],
    ld: usize,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if wide_available() {
        // SAFETY: the CPU has the features `wide_available` checks, the function's only
        // requirement; it bounds-checks its slices.
        return unsafe { x86_512::token_major(w, nb, x, n, out, ld) };
    }
    let _ = (w, nb, x, n, out, ld);
    false
}

/// One Q4_1 weight row against a tile of activation rows; `scales` are the tile's
/// gathered scales (`Acts::tile_scales`) when it is a whole tile.
pub fn dot_q4_1(
    w: &[BlockQ4_1],
    acts: &[&[BlockQ8_1]],
    scales: Option<&[TileScales]>,
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

/// Every row of Q4_1's `w` (`nb` blocks each) against every token of `x`: `out[r * n + t]`,
/// with one choice of instruction set for the whole product and the tiles' gathered scales
/// (`Acts::tile_scales`, or empty).
pub fn rows_q4_1(
    w: &[BlockQ4_1],
    nb: usize,
    x: &[BlockQ8_1],
    scales: &[TileScales],
    n: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if has_vnni() {
        // SAFETY: the CPU has the features (checked), the only requirement; slices are
        // bounds-checked inside.
        unsafe { x86::vnni::q4_1_rows(w, nb, x, scales, n, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has the features (checked), the only requirement; slices are
        // bounds-checked inside.
        unsafe { x86::avx2::q4_1_rows(w, nb, x, scales, n, out) };
        return;
    }
    let _ = scales;
    for (r, row) in w.chunks_exact(nb).enumerate() {
        for t in 0..n {
            out[r * n + t] = scalar::q4_1(row, &x[t * nb..(t + 1) * nb]);
        }
    }
}

/// Portable reference kernels: the definition the SIMD kernels are tested against.
pub mod scalar {
    use super::*;
    use crate::blocks::hsum8;

    /// Q4_1 in the SIMD kernels' float order (llama.cpp's AVX2 `ggml_vec_dot_q4_1_q8_1`):
    /// per block eight lanes of four products (elements `4l..4l + 4`, the low nibbles
    /// being elements 0..16), each lane's exact sum added by a fused multiply-add with
    /// `d_w·d_a`; the offsets `m_w·s_a` summed apart (multiply, then add) and added after
    /// the lanes' [`hsum8`]. So a CPU without AVX2 gives the same bits as one with it.
    pub fn q4_1(w: &[BlockQ4_1], a: &[BlockQ8_1]) -> f32 {
        let mut acc = [0f32; 8];
        let mut summs = 0f32;
        for (wb, ab) in w.iter().zip(a) {
            summs += wb.m * ab.s;
            let d = wb.d * ab.d;
            for (l, acc) in acc.iter_mut().enumerate() {
                let lane: i32 = (4 * l..4 * l + 4)
                    .map(|e| {
                        let q = if e < 16 {
                            wb.qs[e] & 15
                        } else {
                            wb.qs[e - 16] >> 4
                        };
                        i32::from(q) * i32::from(ab.qs[e])
                    })
                    .sum();
                *acc = d.mul_add(lane as f32, *acc);
            }
        }
        hsum8(acc) + summs
    }
}
