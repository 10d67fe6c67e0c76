//! Causal attention over the paged KV cache: each item's new rows attend to K/V read only
//! through its own `SequenceKv::runs` (leases it holds and its domain's shared pages).

use half::f16;
use kv::{KvRun, KvSlice};
use rayon::prelude::*;

use crate::batch::BatchItem;
use crate::kernels::{attend_rows, KvElem, RowsShape};
use crate::{LlamaConfig, ModelError};

/// Causal attention of each item's new rows over its own KV view (pages leased to it and
/// its domain's shared prefix pages; nothing else is reachable from `SequenceKv`).
pub(crate) fn attention(
    c: &LlamaConfig,
    layer: usize,
    items: &[BatchItem<'_>],
    starts: &[usize],
    status: &mut [Result<(), ModelError>],
    q: &[f32],
    attn: &mut [f32],
) {
    // Rows of `q` and `attn` are the concatenated query heads.
    let (dim, hd) = (c.q_dim(), c.head_dim);
    let group = c.n_heads / c.n_kv_heads;
    // Gemma scales Q before attention instead (`LlamaConfig::q_scale`).
    let scale = match c.q_scale {
        Some(_) => 1.0,
        None => 1.0 / (hd as f32).sqrt(),
    };
    let window = c.layers[layer].window;

    let mut views: Vec<Option<Vec<KvRun<'_>>>> = Vec::with_capacity(items.len());
    for (i, it) in items.iter().enumerate() {
        if status[i].is_err() {
            views.push(None);
            continue;
        }
        let upto = it.kv.len() + it.tokens.len();
        match it.kv.runs(layer, upto) {
            Ok(runs) => views.push(Some(runs)),
            Err(e) => {
                status[i] = Err(e.into());
                views.push(None);
            }
        }
    }
    // Tasks: (item, KV head, its query heads h0..h1, block of new rows). Rows and heads are
    // independent, so splitting them keeps both cores busy without changing any head's
    // arithmetic. A KV head's query heads stay together where there is enough other work
    // (the fused kernel interleaves them and reads each K/V row once for all), and are
    // split in two where there is not (a single decode stream has as few tasks as KV heads).
    let threads = rayon::current_num_threads();
    let row_blocks: usize = (0..items.len())
        .filter(|&i| views[i].is_some())
        .map(|i| {
            let n = items[i].tokens.len();
            n.div_ceil(task_rows(n, threads))
        })
        .sum();
    let head_parts = if row_blocks * c.n_kv_heads < 2 * threads {
        group.min(2)
    } else {
        1
    };
    let per_part = group.div_ceil(head_parts);
    let tasks: Vec<Task> = (0..items.len())
        .filter(|&i| views[i].is_some())
        .flat_map(|i| {
            let n = items[i].tokens.len();
            let per_task = task_rows(n, threads);
            (0..c.n_kv_heads).flat_map(move |g| {
                (0..group).step_by(per_part).flat_map(move |h0| {
                    (0..n).step_by(per_task).map(move |t0| Task {
                        item: i,
                        g,
                        heads: h0..(h0 + per_part).min(group),
                        rows: t0..(t0 + per_task).min(n),
                    })
                })
            })
        })
        .collect();
    let results: Vec<(&Task, Vec<f32>)> = tasks
        .par_iter()
        .map(|task| {
            let i = task.item;
            let runs = views[i].as_deref().unwrap_or(&[]);
            let it = &items[i];
            let shape = HeadShape {
                g: task.g,
                group,
                heads: task.heads.clone(),
                hd,
                kv_dim: c.kv_dim(),
                scale,
                window,
            };
            let rows = &q[(starts[i] + task.rows.start) * dim..(starts[i] + task.rows.end) * dim];
            // Position of the task's first row in the sequence.
            let first = it.kv.len() + task.rows.start;
            let out = match runs.first().map(|r| r.k) {
                Some(KvSlice::F32(_)) => attend_typed::<f32>(runs, rows, first, dim, &shape),
                Some(KvSlice::Q8_0(_)) => {
                    attend_typed::<kv::Q8Block>(runs, rows, first, dim, &shape)
                }
                Some(KvSlice::Q4_0(_)) => {
                    attend_typed::<kv::Q4Block>(runs, rows, first, dim, &shape)
                }
                _ => attend_typed::<f16>(runs, rows, first, dim, &shape),
            };
            (task, out)
        })
        .collect();
    for (task, out) in results {
        let width = task.heads.len() * hd;
        let from = (task.g * group + task.heads.start) * hd;
        for (t, row) in out.chunks_exact(width).enumerate() {
            let r = starts[task.item] + task.rows.start + t;
            attn[r * dim + from..r * dim + from + width].copy_from_slice(row);
        }
    }
}

/// Most query rows in one task: every block of K/V is widened once per task, and a row's
/// query and accumulator (8 KiB for four heads of 256) stay in L2 for as many rows as this.
const MAX_ROWS_PER_TASK: usize = 64;

/// Query rows per task for an item of `n` new rows on `threads` threads: the rows cut into
/// near-equal tasks, aiming at a multiple of `threads` of them and at least two per thread
/// (fewer where the rows run out), none over [`MAX_ROWS_PER_TASK`].
///
/// A deep prefill chunk is short (`engine::step_cost` caps its cost), and every layer's
/// attention is one fork-join: with tasks of a fixed 16 rows, a 150-row chunk left one core
/// idle for up to a task at the end of each layer, and Gemma 3 at 30,000 tokens reached its
/// first token in 56–58 s (51–53 with this cut). With fewer tasks than twice the threads,
/// a KV head's query heads are split between tasks instead (see `attention`), which lost
/// more than the larger tasks gained (60–64 s with one task per thread). Rows are
/// independent, so the cut changes no bits.
fn task_rows(n: usize, threads: usize) -> usize {
    let threads = threads.max(1);
    let tasks = threads * n.div_ceil(MAX_ROWS_PER_TASK * threads).max(2);
    n.div_ceil(tasks).max(1)
}

/// A K/V element type as the pool's slices carry it.
trait TypedRows: KvElem {
    fn of(s: KvSlice<'_>) -> Option<&[Self]>;
}

impl TypedRows for f32 {
    fn of(s: KvSlice<'_>) -> Option<&[f32]> {
        match s {
            KvSlice::F32(x) => Some(x),
            _ => None,
        }
    }
}

impl TypedRows for f16 {
    fn of(s: KvSlice<'_>) -> Option<&[f16]> {
        match s {
            KvSlice::F16(x) => Some(x),
            _ => None,
        }
    }
}

impl TypedRows for kv::Q8Block {
    fn of(s: KvSlice<'_>) -> Option<&[kv::Q8Block]> {
        match s {
            KvSlice::Q8_0(x) => Some(x),
            _ => None,
        }
    }
}

impl TypedRows for kv::Q4Block {
    fn of(s: KvSlice<'_>) -> Option<&[kv::Q4Block]> {
        match s {
            KvSlice::Q4_0(x) => Some(x),
            _ => None,
        }
    }
}

/// [`attend_group`] over `runs`, whose slices are all of type `T` (one pool, one type).
fn attend_typed<T: TypedRows>(
    runs: &[KvRun<'_>],
    rows: &[f32],
    first: usize,
    dim: usize,
    shape: &HeadShape,
) -> Vec<f32> {
    let typed: Vec<_> = runs
        .iter()
        .filter_map(|r| Some((T::of(r.k)?, T::of(r.v)?, r.tokens)))
        .collect();
    attend_group::<T>(&typed, rows, first, dim, shape)
}

/// One unit of parallel attention work.
struct Task {
    item: usize,
    /// The KV head.
    g: usize,
    /// Which of its query heads (0..group).
    heads: std::ops::Range<usize>,
    /// Which of the item's new rows.
    rows: std::ops::Range<usize>,
}

struct HeadShape {
    /// The KV head this task serves.
    g: usize,
    /// Query heads per KV head.
    group: usize,
    /// The query heads of this KV head that the task computes.
    heads: std::ops::Range<usize>,
    hd: usize,
    kv_dim: usize,
    scale: f32,
    /// Sliding window: the query at position `p` sees positions from `p + 1 - w` on.
    window: Option<usize>,
}

/// Causal attention of query heads `shape.heads` of KV head `shape.g`, for each of the new
/// rows in `q_rows` (which sit at the end of the cached positions), all at once.
/// `q_rows` are consecutive new rows, the first at sequence position `first`.
fn attend_group<T: KvElem>(
    runs: &[(&[T], &[T], usize)],
    q_rows: &[f32],
    first: usize,
    dim: usize,
    shape: &HeadShape,
) -> Vec<f32> {
    let HeadShape {
        g,
        group,
        ref heads,
        hd,
        kv_dim,
        scale,
        window,
    } = *shape;
    let n_new = q_rows.len() / dim;
    let rows = RowsShape {
        heads: heads.len(),
        hd,
        first,
        base: 0,
        scale,
        window,
    };
    // A sliding window's rows see nothing before the first row's window: those pages were
    // read (and checked) through `SequenceKv::runs` like any other layer's, but their rows
    // are not even gathered, so the work is O(window) per row at any depth.
    let base = rows.from(first);
    let mut k_rows: Vec<&[T]> = Vec::new();
    let mut v_rows: Vec<&[T]> = Vec::new();
    let mut at_pos = 0;
    for (k, v, n) in runs {
        if at_pos + n > base {
            for j in base.saturating_sub(at_pos)..*n {
                // In elements: a Q8_0 element holds 32 values.
                let at = (j * kv_dim + g * hd) / T::VALUES;
                let len = hd / T::VALUES;
                k_rows.push(&k[at..at + len]);
                v_rows.push(&v[at..at + len]);
            }
        }
        at_pos += n;
    }
    let width = heads.len() * hd;
    // llama.cpp converts Q to the cache's element type before the product.
    let mut qs = vec![0f32; n_new * width];
    for (t, q) in qs.chunks_exact_mut(width).enumerate() {
        let at = t * dim + (g * group + heads.start) * hd;
        T::round_queries(&q_rows[at..at + width], q);
    }
    let mut out = vec![0f32; n_new * width];
    attend_rows(&qs, &RowsShape { base, ..rows }, &k_rows, &v_rows, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rows handed to each thread when an item's tasks are dealt out in turn.
    fn loads(n: usize, threads: usize, per_task: usize) -> Vec<usize> {
        let mut load = vec![0; threads];
        for (i, t0) in (0..n).step_by(per_task).enumerate() {
            load[i % threads] += per_task.min(n - t0);
        }
        load
    }

    /// Tasks stay within the row limit yet are as large as it and the threads allow (each
    /// K/V block is widened once per task), and the busiest thread has at most a row per
    /// task over an even share. A fixed 16 rows fails the size bound on a 150-row chunk.
    #[test]
    fn an_items_rows_are_cut_into_even_tasks_for_the_threads() {
        for threads in 1..=8 {
            for n in 1..=2048 {
                let per_task = task_rows(n, threads);
                assert!(
                    (1..=MAX_ROWS_PER_TASK).contains(&per_task),
                    "{n} rows, {threads}"
                );
                assert!(
                    2 * per_task >= n.div_ceil(threads).min(MAX_ROWS_PER_TASK),
                    "{n} rows on {threads} threads: tasks of {per_task}"
                );
                let tasks = n.div_ceil(per_task);
                let most = *loads(n, threads, per_task).iter().max().unwrap();
                assert!(
                    most <= n.div_ceil(threads) + tasks.div_ceil(threads),
                    "{n} rows on {threads} threads: {per_task} per task, {most} on one"
                );
            }
        }
        assert_eq!(task_rows(150, 2), 38);
        assert_eq!(task_rows(100, 2), 25);
        assert_eq!(task_rows(512, 2), 64);
        assert_eq!(task_rows(1, 2), 1);
    }
}
