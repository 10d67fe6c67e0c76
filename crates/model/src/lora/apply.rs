//! A batch's low-rank updates: each row with its own adapter (or none), after the base
//! product that every row shares.
//!
//! Work is split by row, never inside a dot product, so each output's bits are those of its
//! row alone.

use rayon::prelude::*;

use super::{LoraAdapter, LoraPair, Target};
use crate::kernels::{add_scaled_combination, dot_rows_f32};

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

/// Which weight's pair an update uses.
#[derive(Debug, Clone, Copy)]
pub enum Site {
    Layer(usize, Target),
    Output,
}

impl Site {
    fn pair(self, adapter: &LoraAdapter) -> Option<&LoraPair> {
        match self {
            Site::Layer(layer, target) => adapter.pair(layer, target),
            Site::Output => adapter.output_pair(),
        }
    }
}

/// One weight's products to update: the rows' base outputs, `n_out` each.
pub struct Update<'o> {
    pub site: Site,
    pub out: &'o mut [f32],
    pub n_out: usize,
}

/// `out[r] += s · B·(A·x[r])` for every update and every row `r` whose adapter has a pair
/// for that update's weight. `x` holds the rows' inputs, `n_in` each, shared by the
/// updates (Q, K and V read the same normalized rows). Rows run in parallel, each row's
/// updates one after another on one thread: a row's whole update is a few microseconds,
/// so finer tasks would cost more in handoffs than they save.
pub fn add_lora_rows(
    adapters: &RowAdapters<'_>,
    x: &[f32],
    n_in: usize,
    updates: &mut [Update<'_>],
) {
    if !adapters.any() {
        return;
    }
    let n = adapters.len();
    let sites: Vec<(Site, usize)> = updates.iter().map(|u| (u.site, u.n_out)).collect();
    // Each row's slices of every update's output, so rows can go to different threads.
    let mut per_row: Vec<Vec<&mut [f32]>> =
        (0..n).map(|_| Vec::with_capacity(sites.len())).collect();
    for u in updates.iter_mut() {
        for (row, out) in per_row
            .iter_mut()
            .zip(u.out.chunks_exact_mut(u.n_out.max(1)))
        {
            row.push(out);
        }
    }
    let work = |(r, outs): (usize, Vec<&mut [f32]>)| {
        let Some(adapter) = adapters.per_row[r] else {
            return;
        };
        let xr = &x[r * n_in..(r + 1) * n_in];
        let mut u = Vec::new();
        for (&(site, n_out), out) in sites.iter().zip(outs) {
            // The forward pass refuses a sequence whose adapter does not fit this model
            // (`LoraAdapter::fits`); this only keeps every read in bounds regardless.
            let Some(p) = site
                .pair(adapter)
                .filter(|p| p.n_in == n_in && p.n_out == n_out)
            else {
                continue;
            };
            u.clear();
            u.resize(p.rank, 0.0);
            dot_rows_f32(&p.a, xr, &mut u);
            add_scaled_combination(&p.b, n_out, &u, p.factor, out);
        }
    };
    let with_adapter = adapters.per_row.iter().filter(|a| a.is_some()).count();
    if with_adapter < 2 {
        per_row.into_iter().enumerate().for_each(work);
    } else {
        per_row.into_par_iter().enumerate().for_each(work);
    }
}
