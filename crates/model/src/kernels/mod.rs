//! Matrix kernels. The work is split across threads by weight row only; each output value
//! is one dot product computed by the same instruction sequence whatever the batch holds
//! (tiles of several tokens run the identical per-token arithmetic side by side), which is
//! what makes greedy output batch-invariant.

use rayon::prelude::*;

use crate::quant::{quantize_row_q8_k, Acts, BlockQ8K};
use crate::weights::{BlockQ8_1, Matrix, QK};

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

mod activation;
mod attention;
mod quant_dot;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use activation::{ggml_expf, silu, swiglu};
pub use attention::{dot_f16_ggml, KvElem};
pub use quant_dot::{dot_q4_0, dot_q4_1, dot_q8_0, scalar};

#[cfg(test)]
mod tests;
