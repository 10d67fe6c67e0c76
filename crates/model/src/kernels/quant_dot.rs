//! The products of Q4_0 and Q4_1 (the widened-scale blocks): the run-time choice of
//! instruction set (512-bit tiles, VNNI, AVX2, portable) for a whole product, a row or a
//! tile, and the portable reference every SIMD build is tested against.

#[cfg(target_arch = "x86_64")]
use super::cpu::{has_avx2, has_vnni, wide_available};
#[cfg(target_arch = "x86_64")]
use super::{x86, x86_512};
use crate::blocks::{BlockQ4_0, BlockQ4_1, BlockQ8_1, TileScales, TILE};

macro_rules! product {
    ($name:ident, $token_major:ident, $wt:ty, $wide:ident, $wide_tm:ident, $rows:ident) => {
        /// Rows of `w` (`nb` blocks each) against the `n` tokens of `x`, `out[r * n + t]`:
        /// the 512-bit tiles where the CPU has them and there is a tile of tokens, else
        /// the 256-bit or portable rows.
        pub fn $name(w: &[$wt], nb: usize, x: &[BlockQ8_1], n: usize, out: &mut [f32]) {
            #[cfg(target_arch = "x86_64")]
            if n >= TILE && wide_available() {
                // SAFETY: the CPU has the features `wide_available` checks, the function's
                // only requirement; it bounds-checks its slices.
                unsafe { x86_512::$wide(w, nb, x, n, out) };
                return;
            }
            $rows(w, nb, x, n, out);
        }

        /// Rows of `w` against the `n` tokens straight into token-major `out[t * ld + r]`,
        /// where the CPU has the 512-bit tiles and `n` is whole tiles; false (nothing done)
        /// where not.
        pub fn $token_major(
            w: &[$wt],
            nb: usize,
            x: &[BlockQ8_1],
            n: usize,
            out: &mut [f32],
            ld: usize,
        ) -> bool {
            #[cfg(target_arch = "x86_64")]
            if wide_available() {
                // SAFETY: the CPU has the features `wide_available` checks, the function's
                // only requirement; it bounds-checks its slices.
                return unsafe { x86_512::$wide_tm(w, nb, x, n, out, ld) };
            }
            let _ = (w, nb, x, n, out, ld);
            false
        }
    };
}
product!(
    q4_0_product,
    q4_0_token_major,
    BlockQ4_0,
    q4_0_rows,
    q4_0_token_major,
    rows_q4_0
);

/// [`q4_0_product`] for Q4_1, whose 256-bit kernel takes the tiles' gathered scales.
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

/// [`q4_0_token_major`] for Q4_1.
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
dispatch!(dot_q4_0, BlockQ4_0, scalar::q4_0, q4_0);

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

/// [`rows_q4_0`] for Q4_1, with the tiles' gathered scales (`Acts::tile_scales`, or
/// empty).
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
}
