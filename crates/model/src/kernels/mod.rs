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
    // The k-quants take the input as Q8_K super-blocks, quantized once for the group.
    let q8_k = match ws.iter().find(|w| w.wants_q8_k()) {
        Some(w) => {
            let cols = w.cols();
            let nbk = cols / gguf::QK_K;
            let mut q = vec![BlockQ8K::default(); n * nbk];
            // Rows in parallel chunks (one core did them all: 3.6% of a Q2_K prefill).
            let per = n.div_ceil(2 * rayon::current_num_threads()).max(1);
            let chunks = x_f32
                .par_chunks(per * cols)
                .zip(q.par_chunks_mut(per * nbk));
            chunks.for_each(|(x, q)| {
                for (row, o) in x.chunks_exact(cols).zip(q.chunks_exact_mut(nbk)) {
                    quantize_row_q8_k(row, o);
                }
            });
            q
        }
        None => Vec::new(),
    };
    let input = Input {
        x_f32,
        acts: Acts {
            q8_1: x_q8,
            q8_k: &q8_k,
        },
        // Only the 256-bit Q4_1 kernel reads them.
        scales: if ws.iter().any(|w| matches!(w, Matrix::Q4_1 { .. })) {
            tile_scales(x_q8, n, ws[0].cols() / QK)
        } else {
            Vec::new()
        },
        cols: ws[0].cols(),
    };
    if n >= TOKEN_SPLIT_MIN {
        by_token_blocks(ws, &input, outs);
    } else {
        by_row_blocks(ws, &input, n, outs);
    }
}

/// From this many input rows on, the work is split by blocks of tokens, each walking the
/// weights in cache-sized row blocks; below it (decode steps) by weight rows, so that each
/// weight is read from memory once per step.
const TOKEN_SPLIT_MIN: usize = 64;
/// Tokens per task of the token split (a whole number of tiles).
const TOKEN_BLOCK: usize = 8 * TILE;
/// Weight rows whose blocks stay in L1/L2 while a token block passes over them.
const ROW_BLOCK: usize = 64;

/// One group's input in every form a kernel may ask for.
struct Input<'a> {
    x_f32: &'a [f32],
    acts: Acts<'a>,
    scales: Vec<[f32; 2 * TILE]>,
    cols: usize,
}

impl Input<'_> {
    /// The kernels' view of tokens `t0..t0 + nt` (`t0` a multiple of [`TILE`], so tile
    /// indices stay aligned with [`tile_scales`]). Forms the group does not use are empty.
    fn tokens(&self, t0: usize, nt: usize) -> (&[f32], Acts<'_>, &[[f32; 2 * TILE]]) {
        let nb = self.cols / QK;
        let nbk = self.cols / gguf::QK_K;
        let x = self
            .x_f32
            .get(t0 * self.cols..(t0 + nt) * self.cols)
            .unwrap_or(&[]);
        let acts = Acts {
            q8_1: self.acts.q8_1.get(t0 * nb..(t0 + nt) * nb).unwrap_or(&[]),
            q8_k: self.acts.q8_k.get(t0 * nbk..(t0 + nt) * nbk).unwrap_or(&[]),
        };
        let scales = self.scales.get(t0 / TILE * nb..).unwrap_or(&[]);
        (x, acts, scales)
    }
}

/// Each task owns a contiguous run of tokens of one output (token-major, so a plain slice
/// of it) and computes it row block by row block; the kernel's row-major result for the
/// block is transposed while it is still in L1.
fn by_token_blocks(ws: &[&Matrix], input: &Input<'_>, outs: &mut [&mut [f32]]) {
    let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
    for (m, out) in outs.iter_mut().enumerate() {
        let rows = ws[m].rows();
        for (b, chunk) in out.chunks_mut(TOKEN_BLOCK * rows).enumerate() {
            tasks.push((m, b * TOKEN_BLOCK, chunk));
        }
    }
    tasks.into_par_iter().for_each(|(m, t0, chunk)| {
        let w = ws[m];
        let rows = w.rows();
        let nt = chunk.len() / rows;
        let (x, acts, scales) = input.tokens(t0, nt);
        let mut block = vec![0f32; ROW_BLOCK * nt];
        for r0 in (0..rows).step_by(ROW_BLOCK) {
            let nr = ROW_BLOCK.min(rows - r0);
            if rows_token_major(w, r0, nr, &acts, nt, &mut chunk[r0..], rows) {
                continue;
            }
            let block = &mut block[..nr * nt];
            rows_kernel(w, r0, nr, x, &acts, scales, nt, block);
            for (t, out_row) in chunk.chunks_exact_mut(rows).enumerate() {
                for (r, o) in out_row[r0..r0 + nr].iter_mut().enumerate() {
                    *o = block[r * nt + t];
                }
            }
        }
    });
}

/// Rows `r0..r0 + nr` of `w` against the `n` tokens straight into token-major `out`
/// (`out[t * ld + r]`), where a kernel can write that layout; false (nothing done) where not.
fn rows_token_major(
    w: &Matrix,
    r0: usize,
    nr: usize,
    acts: &Acts<'_>,
    n: usize,
    out: &mut [f32],
    ld: usize,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if x86_512::available() {
        let nb = w.cols() / QK;
        let rows = match w {
            Matrix::Q4_0 { data, .. } => x86_512::Rows::Q4_0(&data[r0 * nb..(r0 + nr) * nb]),
            Matrix::Q4_1 { data, .. } => x86_512::Rows::Q4_1(&data[r0 * nb..(r0 + nr) * nb]),
            Matrix::Q8_0 { data, .. } => x86_512::Rows::Q8_0(&data[r0 * nb..(r0 + nr) * nb]),
            Matrix::F32 { .. } => return false,
            Matrix::Blocks(m) => return m.rows_token_major(r0, nr, acts, n, out, ld),
        };
        // SAFETY: the CPU has the features `available` checks, the function's only
        // requirement; it bounds-checks its slices.
        return unsafe { x86_512::rows_token_major(rows, nb, acts.q8_1, n, out, ld) };
    }
    let _ = (w, r0, nr, acts, n, out, ld);
    false
}

/// Tasks own runs of weight rows across every token (one token needs no transposition).
fn by_row_blocks(ws: &[&Matrix], input: &Input<'_>, n: usize, outs: &mut [&mut [f32]]) {
    let threads = rayon::current_num_threads().max(1);
    let total_rows: usize = ws.iter().map(|w| w.rows()).sum();
    let rows_per_task = (total_rows / (threads * 8)).clamp(8, 512);
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
    // Each task's rows come back token-major (`chunk[t * nr + r]`) where its kernel can
    // write that layout, else row-major; either way the chunk is the task's own.
    let token_major: Vec<bool> = tasks
        .into_par_iter()
        .map(|(m, r0, chunk)| {
            let nr = chunk.len() / n;
            if n > 1 && rows_token_major(ws[m], r0, nr, &input.acts, n, chunk, nr) {
                return true;
            }
            rows_kernel(
                ws[m],
                r0,
                nr,
                input.x_f32,
                &input.acts,
                &input.scales,
                n,
                chunk,
            );
            false
        })
        .collect();
    if n != 1 {
        let mut layouts = token_major.into_iter();
        for ((w, buf), out) in ws.iter().zip(&by_row).zip(outs.iter_mut()) {
            let chunks = w.rows().div_ceil(rows_per_task);
            let layout: Vec<bool> = layouts.by_ref().take(chunks).collect();
            assemble_token_major(buf, w.rows(), n, rows_per_task, &layout, out);
        }
    }
}

/// `out[t * rows + r]` from the tasks' chunks of `by_row` (chunk `c` holds rows
/// `c * rows_per_task..`, token-major where `token_major[c]`, else row-major), in parallel
/// over groups of tokens: a token-major chunk is one contiguous copy per token; a row-major
/// one is read a few adjacent values per row (one thread writing token by token across a
/// 49,152-row output layer measured 6% of a loaded server's time, with the other core idle).
fn assemble_token_major(
    by_row: &[f32],
    rows: usize,
    n: usize,
    rows_per_task: usize,
    token_major: &[bool],
    out: &mut [f32],
) {
    const TOKENS_PER_TASK: usize = 4;
    out.par_chunks_mut(TOKENS_PER_TASK * rows)
        .enumerate()
        .for_each(|(g, group)| {
            let t0 = g * TOKENS_PER_TASK;
            let nt = group.len() / rows;
            for (c, (chunk, &tm)) in by_row
                .chunks(rows_per_task * n)
                .zip(token_major)
                .enumerate()
            {
                let (r0, nr) = (c * rows_per_task, chunk.len() / n);
                if tm {
                    for dt in 0..nt {
                        let src = &chunk[(t0 + dt) * nr..(t0 + dt + 1) * nr];
                        group[dt * rows + r0..dt * rows + r0 + nr].copy_from_slice(src);
                    }
                } else {
                    for (r, src) in chunk.chunks_exact(n).enumerate() {
                        for (dt, &v) in src[t0..t0 + nt].iter().enumerate() {
                            group[dt * rows + r0 + r] = v;
                        }
                    }
                }
            }
        });
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
        Matrix::Q4_0 { data, .. } => {
            let rows = &data[r0 * nb..(r0 + nr) * nb];
            #[cfg(target_arch = "x86_64")]
            if n >= TILE && x86_512::available() {
                // SAFETY: the CPU has the features `available` checks, the function's only
                // requirement; it bounds-checks its slices.
                unsafe { x86_512::q4_0_rows(rows, nb, x_q8, n, out) };
                return;
            }
            rows_q4_0(rows, nb, x_q8, n, out);
        }
        Matrix::Q4_1 { data, .. } => {
            let rows = &data[r0 * nb..(r0 + nr) * nb];
            #[cfg(target_arch = "x86_64")]
            if n >= TILE && x86_512::available() {
                // SAFETY: the CPU has the features `available` checks, the function's only
                // requirement; it bounds-checks its slices.
                unsafe { x86_512::q4_1_rows(rows, nb, x_q8, n, out) };
                return;
            }
            rows_q4_1(rows, nb, x_q8, scales, n, out);
        }
        Matrix::Q8_0 { data, .. } => {
            let rows = &data[r0 * nb..(r0 + nr) * nb];
            #[cfg(target_arch = "x86_64")]
            if n >= TILE && x86_512::available() {
                // SAFETY: the CPU has the features `available` checks, the function's only
                // requirement; it bounds-checks its slices.
                unsafe { x86_512::q8_0_rows(rows, nb, x_q8, n, out) };
                return;
            }
            rows_q8_0(rows, nb, x_q8, n, out);
        }
        Matrix::Blocks(m) => m.rows_kernel(r0, nr, acts, n, out),
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

/// The instruction sets the kernels use, detected once: the products ask per row, and
/// even cached detection showed as a few percent of a decode step when asked per row.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Features {
    avx2: bool,
    f16c: bool,
    vnni: bool,
    wide: bool,
}

#[cfg(target_arch = "x86_64")]
fn features() -> Features {
    static FEATURES: std::sync::OnceLock<Features> = std::sync::OnceLock::new();
    *FEATURES.get_or_init(|| {
        use std::arch::is_x86_feature_detected as has;
        // `KVWARDEN_CPU=avx2` keeps the kernels off AVX-512 on a CPU that has it: to measure
        // or test the 256-bit paths (which AVX2-only machines run) on the same machine.
        let cap_avx2 = std::env::var("KVWARDEN_CPU").is_ok_and(|v| v == "avx2");
        let avx2 = has!("avx2") && has!("fma");
        let vnni = avx2 && !cap_avx2 && has!("avx512vnni") && has!("avx512vl");
        Features {
            avx2,
            f16c: avx2 && has!("f16c"),
            vnni,
            wide: vnni && has!("avx512f") && has!("avx512bw") && has!("avx512dq"),
        }
    })
}

#[cfg(target_arch = "x86_64")]
fn has_f16c() -> bool {
    features().f16c
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    features().avx2
}

#[cfg(target_arch = "x86_64")]
fn has_vnni() -> bool {
    features().vnni
}

mod activation;
mod attention;
mod libm_expf;
mod quant_dot;
mod quantize;
mod rope;
#[cfg(target_arch = "x86_64")]
mod tile_out;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_512;
#[cfg(target_arch = "x86_64")]
mod x86_512_kquants;
#[cfg(target_arch = "x86_64")]
mod x86_512_low_kquants;

pub use activation::{ggml_expf, silu, swiglu, table_glu};
pub use attention::{dot_f16_ggml, KvElem};
pub use quant_dot::{dot_q4_0, dot_q4_1, dot_q8_0, rows_q4_0, rows_q4_1, rows_q8_0, scalar};
pub use quantize::{quantize_blocks_q8_1, quantize_blocks_q8_k};
pub use rope::rope_row;
#[cfg(target_arch = "x86_64")]
pub(crate) use x86_512::{available as wide_available, five_bit_tiles};

/// Q5_0 (`with_min` false) or Q5_1 rows (ggml's bytes, `nb` blocks a row) against the `n`
/// tokens straight into token-major `out` (`out[t * ld + r]`), where the CPU has the 512-bit
/// tiles and `n` is whole tiles; false (nothing done) where not.
#[cfg(target_arch = "x86_64")]
pub(crate) fn five_bit_token_major(
    w: &[u8],
    nb: usize,
    x: &[BlockQ8_1],
    n: usize,
    with_min: bool,
    out: &mut [f32],
    ld: usize,
) -> bool {
    if !x86_512::available() {
        return false;
    }
    let rows = if with_min {
        x86_512::Rows::Q5_1(w)
    } else {
        x86_512::Rows::Q5_0(w)
    };
    // SAFETY: the CPU has the features `available` checks, the function's only
    // requirement; it bounds-checks its slices.
    unsafe { x86_512::rows_token_major(rows, nb, x, n, out, ld) }
}
/// Q4_K (`six` false) or Q6_K rows (ggml's bytes, `nb` super-blocks a row) against the
/// whole tiles of the `n` tokens, `out[r * n + t]`; returns the tokens done.
///
/// # Safety
/// The CPU must support the features `x86_512::available` checks. Slices are bounds-checked.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn k_quant_tiles(
    w: &[u8],
    nb: usize,
    x: &[crate::quant::BlockQ8K],
    n: usize,
    six: bool,
    out: &mut [f32],
) -> usize {
    // SAFETY: the caller guarantees the CPU features, the function's only requirement.
    unsafe {
        x86_512_kquants::k_quant_tiles(w, nb, x, n, six, &mut tile_out::Out::RowMajor { out, n })
    }
}
/// Q2_K (`two`) or Q3_K rows: as [`k_quant_tiles`].
///
/// # Safety
/// As [`k_quant_tiles`].
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn low_k_quant_tiles(
    w: &[u8],
    nb: usize,
    x: &[crate::quant::BlockQ8K],
    n: usize,
    two: bool,
    out: &mut [f32],
) -> usize {
    // SAFETY: the caller guarantees the CPU features, the function's only requirement.
    unsafe {
        x86_512_low_kquants::low_k_quant_tiles(
            w,
            nb,
            x,
            n,
            two,
            &mut tile_out::Out::RowMajor { out, n },
        )
    }
}

/// Q2_K, Q3_K, Q4_K or Q6_K rows (`ty`; ggml's bytes, `nb` super-blocks a row) against the
/// `n` tokens straight into token-major `out` (`out[t * ld + r]`), where the CPU has the
/// 512-bit tiles and `n` is whole tiles; false (nothing done) where not.
#[cfg(target_arch = "x86_64")]
pub(crate) fn k_quant_token_major(
    w: &[u8],
    nb: usize,
    x: &[crate::quant::BlockQ8K],
    n: usize,
    ty: gguf::GgmlType,
    out: &mut [f32],
    ld: usize,
) -> bool {
    use gguf::GgmlType;
    if !x86_512::available() || !n.is_multiple_of(TILE) {
        return false;
    }
    let mut out = tile_out::Out::TokenMajor { out, ld };
    // SAFETY (each call): the CPU has the features `available` checks, the functions' only
    // requirement; they bounds-check their slices.
    unsafe {
        match ty {
            GgmlType::Q4_K => x86_512_kquants::k_quant_tiles(w, nb, x, n, false, &mut out),
            GgmlType::Q6_K => x86_512_kquants::k_quant_tiles(w, nb, x, n, true, &mut out),
            GgmlType::Q2_K => x86_512_low_kquants::low_k_quant_tiles(w, nb, x, n, true, &mut out),
            GgmlType::Q3_K => x86_512_low_kquants::low_k_quant_tiles(w, nb, x, n, false, &mut out),
            _ => return false,
        }
    };
    true
}

#[cfg(test)]
mod tests;
