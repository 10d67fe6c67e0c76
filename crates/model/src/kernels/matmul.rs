//! The product driver: a weight matrix (any format, through [`WeightRows`]) against a batch
//! of input rows, split across threads by weight row only; each output value is one dot
//! product computed by the same instruction sequence whatever the batch holds (tiles of
//! several tokens run the identical per-token arithmetic side by side), which is what makes
//! greedy output batch-invariant.

use rayon::prelude::*;

use super::quantize::quantize_row_q8_k;
use crate::blocks::{
    Acts, BlockQ8K, BlockQ8_1, LanesQ8K, LanesQ8_1, TileScales, TilesQ8K, LANE_TOKENS, QK, TILE,
};

/// The activation quantization a format's dot product is defined on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActKind {
    F32,
    Q8_1,
    Q8K,
}

/// What the driver needs of a weight matrix. One call per task of the product: the
/// formats' kernels run behind it, compiled and dispatched as each format chooses.
pub trait WeightRows: Send + Sync {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// The activations the product takes.
    fn act_kind(&self) -> ActKind;
    /// Whether the product reads [`Acts::tile_scales`].
    fn wants_tile_scales(&self) -> bool;
    /// Whether a product of `n` tokens reads [`Acts::q8_k_lanes`].
    fn wants_q8_k_lanes(&self, n: usize) -> bool {
        let _ = n;
        false
    }
    /// Whether a product of `n` tokens reads [`Acts::q8_k_tiles`].
    fn wants_q8_k_tiles(&self, n: usize) -> bool {
        let _ = n;
        false
    }
    /// Whether a product of `n` tokens reads [`Acts::q8_1_lanes`].
    fn wants_q8_1_lanes(&self, n: usize) -> bool {
        let _ = n;
        false
    }
    /// Whether a product of `n` tokens prepares each weight row once per task for every
    /// token of it (so tasks should be long: `lanes_block`).
    fn prepares_rows(&self, n: usize) -> bool {
        self.wants_q8_k_lanes(n) || self.wants_q8_1_lanes(n)
    }
    /// `out[r * n + t] = dot(W[r0 + r], x[t])` for `nr` rows and the `n` tokens of `acts`.
    fn rows_kernel(&self, r0: usize, nr: usize, acts: &Acts<'_>, n: usize, out: &mut [f32]);
    /// Rows `r0..r0 + nr` against the `n` tokens straight into token-major `out`
    /// (`out[t * ld + r]`), where the format has a kernel for that layout; false (nothing
    /// done) where not.
    fn rows_token_major(
        &self,
        r0: usize,
        nr: usize,
        acts: &Acts<'_>,
        n: usize,
        out: &mut [f32],
        ld: usize,
    ) -> bool;
}

/// Rows `r0..r0 + rows` of a matrix as a matrix of their own. Work is split by row only, so
/// its product holds exactly those rows' values of the whole matrix's product: a long
/// product can be computed a slice at a time, with other work between the slices.
pub struct RowSlice<'a, W: ?Sized> {
    pub w: &'a W,
    pub r0: usize,
    pub rows: usize,
}

impl<W: WeightRows + ?Sized> WeightRows for RowSlice<'_, W> {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.w.cols()
    }

    fn act_kind(&self) -> ActKind {
        self.w.act_kind()
    }

    fn wants_tile_scales(&self) -> bool {
        self.w.wants_tile_scales()
    }

    fn wants_q8_k_lanes(&self, n: usize) -> bool {
        self.w.wants_q8_k_lanes(n)
    }

    fn wants_q8_1_lanes(&self, n: usize) -> bool {
        self.w.wants_q8_1_lanes(n)
    }

    fn prepares_rows(&self, n: usize) -> bool {
        self.w.prepares_rows(n)
    }

    fn wants_q8_k_tiles(&self, n: usize) -> bool {
        self.w.wants_q8_k_tiles(n)
    }

    fn rows_kernel(&self, r0: usize, nr: usize, acts: &Acts<'_>, n: usize, out: &mut [f32]) {
        assert!(r0 + nr <= self.rows, "row slice: rows out of range");
        self.w.rows_kernel(self.r0 + r0, nr, acts, n, out);
    }

    fn rows_token_major(
        &self,
        r0: usize,
        nr: usize,
        acts: &Acts<'_>,
        n: usize,
        out: &mut [f32],
        ld: usize,
    ) -> bool {
        assert!(r0 + nr <= self.rows, "row slice: rows out of range");
        self.w.rows_token_major(self.r0 + r0, nr, acts, n, out, ld)
    }
}

/// `out[t * rows + r] = dot(W[r], x[t])` for `n` input rows. `x_f32` is used by f32
/// weights, `x_q8` (the same rows quantized with [`super::quantize_row_q8_1`]) by
/// quantized ones; the caller provides whichever the matrix's `wants_q8` asks for.
pub fn matmul<W: WeightRows + ?Sized>(
    w: &W,
    x_f32: &[f32],
    x_q8: &[BlockQ8_1],
    n: usize,
    out: &mut [f32],
) {
    matmul_group(&[w], x_f32, x_q8, n, &mut [out]);
}

/// Several products of the same input (Q, K and V; gate and up) in one parallel region:
/// one fork-join instead of one per matrix, which matters at decode where each is short.
pub fn matmul_group<W: WeightRows + ?Sized>(
    ws: &[&W],
    x_f32: &[f32],
    x_q8: &[BlockQ8_1],
    n: usize,
    outs: &mut [&mut [f32]],
) {
    assert_eq!(ws.len(), outs.len(), "matmul: one output per matrix");
    for (w, out) in ws.iter().zip(outs.iter()) {
        assert_eq!(out.len(), n * w.rows(), "matmul: output shape");
        let kind = w.act_kind();
        if kind == ActKind::Q8_1 {
            assert_eq!(
                x_q8.len(),
                n * w.cols() / QK,
                "matmul: quantized input shape"
            );
        }
        if kind != ActKind::Q8_1 {
            assert_eq!(x_f32.len(), n * w.cols(), "matmul: input shape");
        }
    }
    // The k-quants take the input as Q8_K super-blocks, quantized once for the group.
    let q8_k = match ws.iter().find(|w| w.act_kind() == ActKind::Q8K) {
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
    let cols = ws[0].cols();
    // Only the 256-bit Q4_1 kernel reads them.
    let scales = if ws.iter().any(|w| w.wants_tile_scales()) {
        tile_scales(x_q8, n, cols / QK)
    } else {
        Vec::new()
    };
    let lanes = if ws.iter().any(|w| w.wants_q8_k_lanes(n)) {
        q8_k_lanes(&q8_k, n, cols / gguf::QK_K)
    } else {
        Vec::new()
    };
    let tiles = if ws.iter().any(|w| w.wants_q8_k_tiles(n)) {
        q8_k_tiles(&q8_k, n, cols / gguf::QK_K)
    } else {
        Vec::new()
    };
    let block_lanes = if ws.iter().any(|w| w.wants_q8_1_lanes(n)) {
        q8_1_lanes(x_q8, n, cols / QK)
    } else {
        Vec::new()
    };
    let input = Input {
        acts: Acts {
            f32: x_f32,
            q8_1: x_q8,
            q8_k: &q8_k,
            tile_scales: &scales,
            q8_k_lanes: &lanes,
            q8_k_tiles: &tiles,
            q8_1_lanes: &block_lanes,
        },
        cols,
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
pub(super) const TOKEN_SPLIT_MIN: usize = 64;
/// Tokens per task of the token split (a whole number of tiles).
pub(super) const TOKEN_BLOCK: usize = 8 * TILE;
const _: () = assert!(TOKEN_BLOCK.is_multiple_of(LANE_TOKENS));
/// The most tokens a task of a tokens-in-lanes product takes (256 against 128: a 1B-shaped
/// Q4_K_M prefill of 500 or 512 tokens 4% faster on a 2-core Zen 4, 3B the same).
const LANES_BLOCK_MAX: usize = 16 * LANE_TOKENS;

/// Tokens per task of a tokens-in-lanes product, whose kernel unpacks every weight row
/// once per task: blocks as long as [`LANES_BLOCK_MAX`], of equal length (whole lane
/// groups) and as many as a multiple of the threads before that rounding, so that each
/// core gets a near-equal share of the fewest blocks. (Blocks of 32 tokens up to 255
/// tokens, 64 up to 511 and 128 from 512 left a 500-token Llama-3.2-1B-shaped Q4_K_M
/// prefill 10% slower per token than a 512-token one on a 2-core Zen 4.)
pub(super) fn lanes_block(tokens: usize, threads: usize) -> usize {
    let blocks = tokens
        .div_ceil(LANES_BLOCK_MAX)
        .next_multiple_of(threads.max(1));
    tokens.div_ceil(blocks).next_multiple_of(LANE_TOKENS)
}

/// Weight rows whose blocks stay in L1/L2 while a token block passes over them.
pub(super) const ROW_BLOCK: usize = 64;

/// One group's input in every form a kernel may ask for.
struct Input<'a> {
    acts: Acts<'a>,
    cols: usize,
}

impl Input<'_> {
    /// The kernels' view of tokens `t0..t0 + nt` (`t0` a multiple of [`TOKEN_BLOCK`], so
    /// tile indices stay aligned with [`tile_scales`] and lane groups with
    /// [`q8_k_lanes`]). Forms the group does not use are empty.
    fn tokens(&self, t0: usize, nt: usize) -> Acts<'_> {
        let nb = self.cols / QK;
        let nbk = self.cols / gguf::QK_K;
        let x = self
            .acts
            .f32
            .get(t0 * self.cols..(t0 + nt) * self.cols)
            .unwrap_or(&[]);
        Acts {
            f32: x,
            q8_1: self.acts.q8_1.get(t0 * nb..(t0 + nt) * nb).unwrap_or(&[]),
            q8_k: self.acts.q8_k.get(t0 * nbk..(t0 + nt) * nbk).unwrap_or(&[]),
            tile_scales: self.acts.tile_scales.get(t0 / TILE * nb..).unwrap_or(&[]),
            q8_k_lanes: self
                .acts
                .q8_k_lanes
                .get(t0 / LANE_TOKENS * nbk..(t0 + nt).div_ceil(LANE_TOKENS) * nbk)
                .unwrap_or(&[]),
            q8_k_tiles: self
                .acts
                .q8_k_tiles
                .get(t0 / LANE_TOKENS * nbk..(t0 + nt).div_ceil(LANE_TOKENS) * nbk)
                .unwrap_or(&[]),
            q8_1_lanes: self
                .acts
                .q8_1_lanes
                .get(t0 / LANE_TOKENS * nb..(t0 + nt).div_ceil(LANE_TOKENS) * nb)
                .unwrap_or(&[]),
        }
    }
}

/// Each task owns a contiguous run of tokens of one output (token-major, so a plain slice
/// of it) and computes it row block by row block; the kernel's row-major result for the
/// block is transposed while it is still in L1.
fn by_token_blocks<W: WeightRows + ?Sized>(ws: &[&W], input: &Input<'_>, outs: &mut [&mut [f32]]) {
    let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
    let threads = rayon::current_num_threads().max(1);
    for (m, out) in outs.iter_mut().enumerate() {
        let rows = ws[m].rows();
        // Longer blocks from 256 tokens: a kernel's per-row preparation then serves more
        // tokens, while shorter products keep enough tasks for every core.
        let tokens = out.len() / rows;
        let lanes = ws[m].prepares_rows(tokens);
        let block = if lanes {
            lanes_block(tokens, threads)
        } else if tokens >= 256 {
            2 * TOKEN_BLOCK
        } else {
            TOKEN_BLOCK
        };
        for (b, chunk) in out.chunks_mut(block * rows).enumerate() {
            tasks.push((m, b * block, chunk));
        }
    }
    tasks.into_par_iter().for_each(|(m, t0, chunk)| {
        let w = ws[m];
        let rows = w.rows();
        let nt = chunk.len() / rows;
        let acts = input.tokens(t0, nt);
        let mut block = vec![0f32; ROW_BLOCK * nt];
        for r0 in (0..rows).step_by(ROW_BLOCK) {
            let nr = ROW_BLOCK.min(rows - r0);
            if w.rows_token_major(r0, nr, &acts, nt, &mut chunk[r0..], rows) {
                continue;
            }
            let block = &mut block[..nr * nt];
            w.rows_kernel(r0, nr, &acts, nt, block);
            for (t, out_row) in chunk.chunks_exact_mut(rows).enumerate() {
                for (r, o) in out_row[r0..r0 + nr].iter_mut().enumerate() {
                    *o = block[r * nt + t];
                }
            }
        }
    });
}

/// Rows per task of a product split by weight rows (`total_rows` over all the group's
/// matrices): about eight tasks per thread, from 16 to 512 rows, and always whole tiles of
/// sixteen rows. A task that starts or ends inside one of the repacked k-quant tiles
/// (`quant/interleaved.rs`) rebuilds ggml's blocks for its rows, which cost a 576-wide
/// model's Q4_K_M decode 40% of its speed.
fn row_task_rows(total_rows: usize, threads: usize) -> usize {
    (total_rows / (threads.max(1) * 8))
        .clamp(TASK_ROWS_ALIGN, 512)
        .next_multiple_of(TASK_ROWS_ALIGN)
}

/// The repacked tiles' rows, on every target (the tiles exist on x86-64 only).
const TASK_ROWS_ALIGN: usize = 16;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(TASK_ROWS_ALIGN == super::x86_512_rows_lanes::TILE_ROWS);

/// Tasks own runs of weight rows across every token (one token needs no transposition).
fn by_row_blocks<W: WeightRows + ?Sized>(
    ws: &[&W],
    input: &Input<'_>,
    n: usize,
    outs: &mut [&mut [f32]],
) {
    let total_rows: usize = ws.iter().map(|w| w.rows()).sum();
    let rows_per_task = row_task_rows(total_rows, rayon::current_num_threads());
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
            if n > 1 && ws[m].rows_token_major(r0, nr, &input.acts, n, chunk, nr) {
                return true;
            }
            ws[m].rows_kernel(r0, nr, &input.acts, n, chunk);
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

/// The `n` Q8_K rows (`nb` super-blocks each) as lane blocks, `[group * nb + i]`, groups
/// of [`LANE_TOKENS`] tokens (the last padded), built in parallel by group.
pub(crate) fn q8_k_lanes(x: &[BlockQ8K], n: usize, nb: usize) -> Vec<LanesQ8K> {
    let groups = n.div_ceil(LANE_TOKENS);
    let empty = LanesQ8K {
        q: [[0; 64]; gguf::QK_K / 4],
        d: [0.0; LANE_TOKENS],
        sum_pairs: [[0; LANE_TOKENS]; 4],
    };
    let mut out = vec![empty; groups * nb];
    out.par_chunks_mut(nb).enumerate().for_each(|(g, o)| {
        let t0 = g * LANE_TOKENS;
        let rows: Vec<&[BlockQ8K]> = (t0..n.min(t0 + LANE_TOKENS))
            .map(|t| &x[t * nb..(t + 1) * nb])
            .collect();
        LanesQ8K::fill(&rows, o);
    });
    out
}

/// The Q8_K rows `x` (`n` tokens, `nb` super-blocks each) as AMX's tiles:
/// `[group * nb + i]`.
pub(crate) fn q8_k_tiles(x: &[BlockQ8K], n: usize, nb: usize) -> Vec<TilesQ8K> {
    let groups = n.div_ceil(LANE_TOKENS);
    let mut out = vec![TilesQ8K::EMPTY; groups * nb];
    out.par_chunks_mut(nb).enumerate().for_each(|(g, o)| {
        let t0 = g * LANE_TOKENS;
        let rows: Vec<&[BlockQ8K]> = (t0..n.min(t0 + LANE_TOKENS))
            .map(|t| &x[t * nb..(t + 1) * nb])
            .collect();
        TilesQ8K::fill(&rows, o);
    });
    out
}

/// [`q8_k_lanes`] for Q8_1 rows: `[group * nb + block]`.
pub(crate) fn q8_1_lanes(x: &[BlockQ8_1], n: usize, nb: usize) -> Vec<LanesQ8_1> {
    let groups = n.div_ceil(LANE_TOKENS);
    let empty = LanesQ8_1 {
        q: [[0; 64]; QK / 4],
        d: [0.0; LANE_TOKENS],
    };
    let mut out = vec![empty; groups * nb];
    out.par_chunks_mut(nb).enumerate().for_each(|(g, o)| {
        let t0 = g * LANE_TOKENS;
        let rows: Vec<&[BlockQ8_1]> = (t0..n.min(t0 + LANE_TOKENS))
            .map(|t| &x[t * nb..(t + 1) * nb])
            .collect();
        LanesQ8_1::fill(&rows, o);
    });
    out
}

/// The activation scales of every whole tile, laid out for the kernels:
/// `[tile * nb + block] = [d of its 4 tokens, s of its 4 tokens]`, so a kernel scales four
/// tokens with one vector multiply instead of four scalar ones (same products, same bits).
pub(super) fn tile_scales(x: &[BlockQ8_1], n: usize, nb: usize) -> Vec<TileScales> {
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

#[cfg(test)]
mod tests {
    use super::row_task_rows;

    /// Every decode split starts and ends its tasks on tile boundaries (the last task of a
    /// matrix ends with the matrix), for the shapes served and odd ones, on any thread
    /// count; and keeps about eight tasks per thread within its bounds.
    #[test]
    fn row_tasks_are_whole_tiles() {
        // Served models' groups (576-wide QKV, 1B's, 3B's, an FFN, the 128k output) and odd.
        let shapes = [16, 48, 576, 1536, 3072, 9216, 16384, 128_256, 1 << 20];
        for threads in [0, 1, 2, 3, 7, 16, 64] {
            for total in shapes {
                let rows = row_task_rows(total, threads);
                assert_eq!(rows % 16, 0, "{total} rows, {threads} threads: {rows}");
                assert!((16..=512).contains(&rows), "{total}, {threads}: {rows}");
                let tasks = total.div_ceil(rows);
                if rows > 16 && rows < 512 {
                    let per = tasks as f64 / threads.max(1) as f64;
                    assert!((4.0..=8.5).contains(&per), "{total}, {threads}: {tasks}");
                }
            }
        }
    }
}
