//! Causal attention over the paged KV cache: each item's new rows attend to K/V read only
//! through its own `SequenceKv::runs` (leases it holds and its domain's shared pages).

use half::f16;
use kv::{KvRun, KvSlice};
use rayon::prelude::*;

use crate::forward::BatchItem;
use crate::kernels::KvElem;
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
    // Tasks: (item, KV head, block of new rows). Rows are independent, so splitting a long
    // prompt's rows keeps both cores busy without changing any row's arithmetic.
    const ROWS_PER_TASK: usize = 16;
    let tasks: Vec<(usize, usize, usize, usize)> = (0..items.len())
        .filter(|&i| views[i].is_some())
        .flat_map(|i| {
            let n = items[i].tokens.len();
            (0..c.n_kv_heads).flat_map(move |g| {
                (0..n)
                    .step_by(ROWS_PER_TASK)
                    .map(move |t0| (i, g, t0, (t0 + ROWS_PER_TASK).min(n)))
            })
        })
        .collect();
    let results: Vec<(usize, usize, usize, Vec<f32>)> = tasks
        .par_iter()
        .map(|&(i, g, t0, t1)| {
            let runs = views[i].as_deref().unwrap_or(&[]);
            let it = &items[i];
            let shape = HeadShape {
                g,
                group,
                hd,
                kv_dim: c.kv_dim(),
                scale,
                window,
            };
            let rows = &q[(starts[i] + t0) * dim..(starts[i] + t1) * dim];
            // Position of row t0 in the sequence.
            let first = it.kv.len() + t0;
            let out = match runs.first().map(|r| r.k) {
                Some(KvSlice::F32(_)) => {
                    let typed: Vec<_> = runs
                        .iter()
                        .filter_map(|r| match (r.k, r.v) {
                            (KvSlice::F32(k), KvSlice::F32(v)) => Some((k, v, r.tokens)),
                            _ => None,
                        })
                        .collect();
                    attend_group::<f32>(&typed, rows, first, dim, &shape)
                }
                _ => {
                    let typed: Vec<_> = runs
                        .iter()
                        .filter_map(|r| match (r.k, r.v) {
                            (KvSlice::F16(k), KvSlice::F16(v)) => Some((k, v, r.tokens)),
                            _ => None,
                        })
                        .collect();
                    attend_group::<f16>(&typed, rows, first, dim, &shape)
                }
            };
            (i, g, t0, out)
        })
        .collect();
    for (i, g, t0, out) in results {
        for (t, row) in out.chunks_exact(group * hd).enumerate() {
            let r = starts[i] + t0 + t;
            attn[r * dim + g * group * hd..r * dim + (g + 1) * group * hd].copy_from_slice(row);
        }
    }
}

struct HeadShape {
    /// The KV head this task serves.
    g: usize,
    /// Query heads per KV head.
    group: usize,
    hd: usize,
    kv_dim: usize,
    scale: f32,
    /// Sliding window: the query at position `p` sees positions from `p + 1 - w` on.
    window: Option<usize>,
}

/// Causal attention of the query heads that share KV head `shape.g`, for each of the new
/// rows in `q_rows` (which sit at the end of the cached positions).
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
        hd,
        kv_dim,
        scale,
        window,
    } = *shape;
    let mut k_rows: Vec<&[T]> = Vec::new();
    let mut v_rows: Vec<&[T]> = Vec::new();
    for (k, v, n) in runs {
        for j in 0..*n {
            let at = j * kv_dim + g * hd;
            k_rows.push(&k[at..at + hd]);
            v_rows.push(&v[at..at + hd]);
        }
    }
    let n_new = q_rows.len() / dim;
    let mut out = vec![0f32; n_new * group * hd];
    let mut acc = vec![T::Acc::default(); hd];
    let mut heads = vec![0f32; group * hd];
    for (t, out) in out.chunks_exact_mut(group * hd).enumerate() {
        let visible = first + t + 1;
        // Every slot was read (and checked) through `SequenceKv::runs` like any other
        // layer's; the window only leaves the older ones out of the sum.
        let from = window.map_or(0, |w| visible.saturating_sub(w));
        let row = &q_rows[t * dim + g * group * hd..t * dim + (g + 1) * group * hd];
        for (h, &x) in heads.iter_mut().zip(row) {
            // llama.cpp converts Q to the cache's element type before the product.
            *h = T::round_query(x);
        }
        let qs: Vec<&[f32]> = heads.chunks_exact(hd).collect();
        let mut outs: Vec<&mut [f32]> = out.chunks_exact_mut(hd).collect();
        T::attend_heads(
            &qs,
            &k_rows[from..visible],
            &v_rows[from..visible],
            scale,
            &mut acc,
            &mut outs,
        );
    }
    out
}
