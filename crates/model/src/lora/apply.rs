//! A batch's low-rank updates: each row with its own adapter (or none), after the base
//! product that every row shares.
//!
//! Work is split by row for `A·x` and by (row, block of outputs) for `B·u`, never inside a
//! dot product, so each output's bits are those of its row alone.

use rayon::prelude::*;

use super::{LoraAdapter, LoraPair};
use crate::kernels::{add_scaled_combination, dot_rows_f32};

/// Outputs per task of the `B·u` half: a row's update split this finely keeps both cores
/// busy on a decode step of a few rows.
const OUT_BLOCK: usize = 256;

/// Each row's adapter for one forward step (`None`: the base model).
#[derive(Clone, Default)]
pub struct RowAdapters<'a> {
    per_row: Vec<Option<&'a LoraAdapter>>,
}

impl<'a> RowAdapters<'a> {
    pub fn new(per_row: Vec<Option<&'a LoraAdapter>>) -> Self {
        Self { per_row }
    }

    /// Whether any row has an adapter (a base-only batch skips every update).
    pub fn any(&self) -> bool {
        self.per_row.iter().any(Option::is_some)
    }

    /// The adapters of the given rows, in that order (the rows whose logits are computed).
    pub fn select(&self, rows: &[usize]) -> Self {
        Self {
            per_row: rows.iter().map(|&r| self.per_row[r]).collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.per_row.len()
    }

    pub fn is_empty(&self) -> bool {
        self.per_row.is_empty()
    }
}

/// `out[r] += s · B·(A·x[r])` for every row `r` whose adapter has a pair for this weight
/// (`pair_of` picks it). `x` holds the rows' inputs, `n_in` each; `out` the base products,
/// `n_out` each.
pub fn add_lora_rows<'a>(
    adapters: &RowAdapters<'a>,
    pair_of: impl Fn(&'a LoraAdapter) -> Option<&'a LoraPair> + Sync,
    x: &[f32],
    n_in: usize,
    out: &mut [f32],
    n_out: usize,
) {
    if !adapters.any() {
        return;
    }
    let pairs: Vec<Option<&LoraPair>> = adapters
        .per_row
        .iter()
        .map(|a| a.and_then(&pair_of))
        // Loading checked every pair against this model's shapes; one that does not fit
        // (an adapter handed to another model) changes nothing rather than read out of
        // bounds.
        .map(|p| p.filter(|p| p.n_in == n_in && p.n_out == n_out))
        .collect();
    // `A·x` per row: `rank` values each.
    let down: Vec<Option<Vec<f32>>> = pairs
        .par_iter()
        .enumerate()
        .map(|(r, pair)| {
            pair.map(|p| {
                let mut u = vec![0f32; p.rank];
                dot_rows_f32(&p.a, &x[r * n_in..(r + 1) * n_in], &mut u);
                u
            })
        })
        .collect();
    out.par_chunks_mut(n_out)
        .zip(pairs.par_iter().zip(down.par_iter()))
        .for_each(|(row_out, (pair, u))| {
            let (Some(p), Some(u)) = (pair, u) else {
                return;
            };
            row_out
                .par_chunks_mut(OUT_BLOCK)
                .enumerate()
                .for_each(|(block, outs)| {
                    let first = block * OUT_BLOCK;
                    add_scaled_combination(&p.b[first..], n_out, u, p.factor, outs);
                });
        });
}
