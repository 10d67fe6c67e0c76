//! One weight row against a tile of activation rows, per quantization type: the run-time
//! choice of instruction set, and the portable reference every SIMD build is tested against.

use super::TILE;
#[cfg(target_arch = "x86_64")]
use super::{has_avx2, has_vnni, x86};
use crate::weights::{BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1};

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

macro_rules! rows_dispatch {
    ($name:ident, $wt:ty, $scalar:path, $simd:ident) => {
        /// Every row of `w` (`nb` blocks each) against every token of `x`:
        /// `out[r * n + t]`, with one choice of instruction set for the whole product.
        pub fn $name(w: &[$wt], nb: usize, x: &[BlockQ8_1], n: usize, out: &mut [f32]) {
            #[cfg(target_arch = "x86_64")]
            if has_vnni() {
                // SAFETY: the CPU supports AVX2, FMA, AVX-512 VNNI and VL (checked), the only
                // requirement; slices are bounds-checked inside.
                unsafe { x86::vnni::$simd(w, nb, x, n, out) };
                return;
            }
            #[cfg(target_arch = "x86_64")]
            if has_avx2() {
                // SAFETY: the CPU supports AVX2 and FMA (checked), the only requirement;
                // slices are bounds-checked inside.
                unsafe { x86::avx2::$simd(w, nb, x, n, out) };
                return;
            }
            for (r, row) in w.chunks_exact(nb).enumerate() {
                for t in 0..n {
                    out[r * n + t] = $scalar(row, &x[t * nb..(t + 1) * nb]);
                }
            }
        }
    };
}
rows_dispatch!(rows_q4_0, BlockQ4_0, scalar::q4_0, q4_0_rows);
rows_dispatch!(rows_q8_0, BlockQ8_0, scalar::q8_0, q8_0_rows);

/// [`rows_q4_0`] for Q4_1, with the tiles' gathered scales ([`super::tile_scales`], or
/// empty).
pub fn rows_q4_1(
    w: &[BlockQ4_1],
    nb: usize,
    x: &[BlockQ8_1],
    scales: &[[f32; 2 * TILE]],
    n: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if has_vnni() {
        // SAFETY: as in `rows_q4_0`.
        unsafe { x86::vnni::q4_1_rows(w, nb, x, scales, n, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: as in `rows_q4_0`.
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
