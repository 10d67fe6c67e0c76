//! The per-row steps between the matrix products (norms, Q8_1 quantization, residual
//! adds), split into row chunks across the cores.

use rayon::prelude::*;

use crate::weights::{quantize_row_q8_1, BlockQ8_1, QK};

/// Gemma's norm of a sublayer's output before it joins the residual stream.
fn post_norm(out: &mut [f32], weight: &Option<Vec<f32>>, eps: f32, width: usize) {
    if let Some(w) = weight {
        let raw = out.to_vec();
        rms_norm_rows(&raw, w, eps, width, out);
    }
}

pub(super) fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Rows per parallel chunk of the per-row steps between the products (norms, quantization,
/// RoPE, activations, residual adds): every core takes a share instead of one core doing
/// them while the others wait for the next product (they were 6-7% of a prefill's CPU time,
/// all of it on one core). Each row's arithmetic is unchanged, so the bits are too.
/// Below [`PAR_ROWS_MIN`] rows (a decode step of a few streams) it is all of them, done on
/// the calling thread: there the fork-join cost more than it saved (-4% single-stream decode).
pub(super) fn rows_per_chunk(n: usize) -> usize {
    if n < PAR_ROWS_MIN {
        n.max(1)
    } else {
        n.div_ceil(2 * rayon::current_num_threads())
    }
}

/// See [`rows_per_chunk`].
const PAR_ROWS_MIN: usize = 8;

/// `xn = rms_norm(x) * weight`, then `xq` its Q8_1 blocks (none where `xq` is empty: no
/// product of the model reads them), row chunks on every core.
pub(super) fn norm_quantize(
    x: &[f32],
    weight: &[f32],
    eps: f32,
    width: usize,
    xn: &mut [f32],
    xq: &mut [BlockQ8_1],
) {
    let per = rows_per_chunk(x.len() / width);
    let quantize = !xq.is_empty();
    let step = |(x, xn): (&[f32], &mut [f32]), xq: &mut [BlockQ8_1]| {
        rms_norm_rows(x, weight, eps, width, xn);
        if quantize {
            quantize_rows_here(xn, width, xq);
        }
    };
    if per * width >= x.len() {
        return step((x, xn), xq);
    }
    let chunks = x
        .par_chunks(per * width)
        .zip(xn.par_chunks_mut(per * width));
    if quantize {
        chunks
            .zip(xq.par_chunks_mut(per * width / QK))
            .for_each(|(rows, xq)| step(rows, xq));
    } else {
        chunks.for_each(|rows| step(rows, &mut []));
    }
}

/// `x += post_norm(proj)`: a sublayer's output joining the residual stream (Gemma normalizes
/// it first), row chunks on every core.
pub(super) fn residual(
    x: &mut [f32],
    proj: &mut [f32],
    post: &Option<Vec<f32>>,
    eps: f32,
    width: usize,
) {
    let per = rows_per_chunk(x.len() / width);
    let step = |(x, proj): (&mut [f32], &mut [f32])| {
        post_norm(proj, post, eps, width);
        add_in_place(x, proj);
    };
    if per * width >= x.len() {
        return step((x, proj));
    }
    let chunks = x
        .par_chunks_mut(per * width)
        .zip(proj.par_chunks_mut(per * width));
    chunks.for_each(step);
}

/// Each row's Q8_1 blocks, row chunks on every core; nothing where `out` is empty (no
/// product reads them).
pub(super) fn quantize_rows(x: &[f32], width: usize, out: &mut [BlockQ8_1]) {
    if out.is_empty() {
        return;
    }
    let per = rows_per_chunk(x.len() / width);
    if per * width >= x.len() {
        return quantize_rows_here(x, width, out);
    }
    let chunks = x
        .par_chunks(per * width)
        .zip(out.par_chunks_mut(per * width / QK));
    chunks.for_each(|(x, out)| quantize_rows_here(x, width, out));
}

/// [`quantize_rows`] on the calling thread (within a chunk already parallel).
pub(super) fn quantize_rows_here(x: &[f32], width: usize, out: &mut [BlockQ8_1]) {
    let nb = width / QK;
    for (row, o) in x.chunks_exact(width).zip(out.chunks_exact_mut(nb)) {
        quantize_row_q8_1(row, o);
    }
}

/// RMSNorm as ggml computes it (sum of squares in f64), then the learned scale.
pub(super) fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, width: usize, out: &mut [f32]) {
    // Each row's sum is one chain of dependent f64 additions, in element order as ggml adds
    // them; four rows' chains run side by side so that they overlap (same additions, same
    // order within each row).
    const ROWS_TOGETHER: usize = 4;
    let group = ROWS_TOGETHER * width;
    let (whole, rest) = x.split_at(x.len() / group * group);
    let (out_whole, out_rest) = out.split_at_mut(whole.len());
    for (xs, outs) in whole
        .chunks_exact(group)
        .zip(out_whole.chunks_exact_mut(group))
    {
        let rows: [&[f32]; ROWS_TOGETHER] =
            std::array::from_fn(|j| &xs[j * width..(j + 1) * width]);
        let mut sums = [0f64; ROWS_TOGETHER];
        for i in 0..width {
            for (sum, row) in sums.iter_mut().zip(&rows) {
                *sum += (row[i] * row[i]) as f64;
            }
        }
        for ((row, o), sum) in rows.iter().zip(outs.chunks_exact_mut(width)).zip(sums) {
            scale_row(row, weight, eps, width, sum, o);
        }
    }
    for (row, o) in rest
        .chunks_exact(width)
        .zip(out_rest.chunks_exact_mut(width))
    {
        let sum: f64 = row.iter().map(|&v| (v * v) as f64).sum();
        scale_row(row, weight, eps, width, sum, o);
    }
}

/// `o = row / sqrt(mean + eps) * weight`, the mean from the row's sum of squares.
fn scale_row(row: &[f32], weight: &[f32], eps: f32, width: usize, sum: f64, o: &mut [f32]) {
    let mean = (sum / width as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((ov, &xv), &w) in o.iter_mut().zip(row).zip(weight) {
        *ov = (xv * scale) * w;
    }
}
