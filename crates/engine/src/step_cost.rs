//! What a prefill chunk costs at its depth, so that a long prompt's chunk never holds a step
//! longer than `max_batch_tokens` tokens would at the start of a prompt.
//!
//! A prompt token costs its weight products (the same at any depth) plus attention over every
//! position it sees, which grows with its position: at 8,000 positions on the default model a
//! token's attention is about three times its products, so a fixed 512-token chunk there took
//! four times as long as at the start, and every other stream's next token waited that long.
//! Chunks are capped instead so that their estimated cost stays within the budget's cost at
//! depth 0 (tokens change only how a prompt is chunked, never its bits: chunk invariance).

use model::LlamaConfig;

/// Attention's multiply-adds run at about this fraction of the weight products' rate
/// (measured on the default model, AVX-512: a head-key of 64 elements (128 multiply-adds)
/// takes 3.8 ns, the products about 3 ns per 128).
const ATTENTION_EFFICIENCY: f64 = 0.8;

/// Per-token costs of one model, in weight-product multiply-adds.
#[derive(Debug, Clone)]
pub(crate) struct StepCost {
    /// A token's weight products.
    weights: f64,
    /// Per layer: its query heads × head size × 2 (K·Q and V) / efficiency, and its window.
    layers: Vec<(f64, Option<usize>)>,
    /// Tokens per step (`max_batch_tokens`), and the cost of a chunk of that many at a
    /// prompt's start: what every chunk may cost.
    budget: usize,
    allowed: f64,
}

impl StepCost {
    /// The costs of the model `c`, for steps of `budget` tokens.
    pub(crate) fn of(c: &LlamaConfig, budget: usize) -> Self {
        let (dim, q, kv, ffn) = (c.dim, c.q_dim(), c.kv_dim(), c.ffn_dim);
        let per_layer = dim * (q + 2 * kv) + q * dim + 3 * dim * ffn;
        let attention = (2 * c.n_heads * c.head_dim) as f64 / ATTENTION_EFFICIENCY;
        Self::new(
            (c.n_layers * per_layer) as f64,
            c.layers.iter().map(|l| (attention, l.window)).collect(),
            budget,
        )
    }

    fn new(weights: f64, layers: Vec<(f64, Option<usize>)>, budget: usize) -> Self {
        let mut cost = Self {
            weights,
            layers,
            budget,
            allowed: f64::INFINITY,
        };
        cost.allowed = cost.chunk(0, budget, f64::INFINITY).1;
        cost
    }

    /// One token's cost at position `p`.
    fn token(&self, p: usize) -> f64 {
        self.weights
            + self
                .layers
                .iter()
                .map(|&(a, w)| a * w.map_or(p + 1, |w| w.min(p + 1)) as f64)
                .sum::<f64>()
    }

    /// The most tokens of a prompt chunk starting at position `start` whose cost stays within
    /// that of a full-budget chunk at the prompt's start (so a first chunk keeps the whole
    /// budget; at least one token).
    pub(crate) fn chunk_cap(&self, start: usize) -> usize {
        if start == 0 {
            return self.budget;
        }
        self.chunk(start, self.budget, self.allowed).0.max(1)
    }

    /// Tokens from `start` (up to `most`) whose cost stays within `allowed`, and that cost;
    /// estimated 16 tokens at a time at each group's last position (cost grows with
    /// position), which keeps the loop short.
    fn chunk(&self, start: usize, most: usize, allowed: f64) -> (usize, f64) {
        let (mut n, mut spent) = (0, 0.0);
        while n < most {
            let step = 16.min(most - n);
            let cost = step as f64 * self.token(start + n + step - 1);
            if spent + cost > allowed {
                break;
            }
            spent += cost;
            n += step;
        }
        (n, spent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(window: Option<usize>) -> StepCost {
        StepCost::new(100_000.0, vec![(100.0, window); 4], 512)
    }

    #[test]
    fn a_chunk_at_the_start_gets_the_whole_budget() {
        assert_eq!(cost(None).chunk_cap(0), 512);
        assert_eq!(cost(Some(64)).chunk_cap(0), 512);
    }

    #[test]
    fn a_deep_chunk_is_shorter_and_costs_no_more_than_the_budget() {
        let c = cost(None);
        let cap = c.chunk_cap(8000);
        assert!(cap < 512 / 3, "{cap}");
        let spent: f64 = (8000..8000 + cap).map(|p| c.token(p)).sum();
        let first: f64 = (0..512).map(|p| c.token(p)).sum();
        assert!(spent <= first, "{spent} > {first}");
        assert_eq!(c.chunk_cap(1 << 30), 1, "always at least one token");
    }

    #[test]
    fn a_sliding_window_stops_the_growth() {
        let windowed = cost(Some(512));
        assert_eq!(windowed.chunk_cap(8000), windowed.chunk_cap(100_000));
    }
}
