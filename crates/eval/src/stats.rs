//! The run's totals and their summary: perplexity, and against a base the KL divergence's
//! mean and tail, top-1 agreement, RMS Δp, with llama-perplexity's estimators (its mean ±
//! uncertainty, its interpolated percentiles), so the figures read side by side with its.

use serde::Serialize;

use crate::row::RowScore;

/// Every scored position's contribution, in order.
#[derive(Debug, Default)]
pub struct Totals {
    nll: Vec<f64>,
    /// Present when a base was given.
    against_base: Option<BaseTotals>,
}

#[derive(Debug, Default)]
struct BaseTotals {
    nll_base: Vec<f64>,
    kld: Vec<f64>,
    p_diff: Vec<f64>,
    same_top: usize,
    identical_rows: usize,
}

impl Totals {
    pub fn with_base() -> Self {
        Self {
            nll: Vec::new(),
            against_base: Some(BaseTotals::default()),
        }
    }

    pub fn add_nll(&mut self, nll: f32) {
        self.nll.push(f64::from(nll));
    }

    /// A position scored against the base; `identical` when its stored form equals the
    /// base's bit for bit.
    pub fn add_scored(&mut self, score: RowScore, identical: bool) {
        self.nll.push(f64::from(score.nll));
        let b = self
            .against_base
            .as_mut()
            .expect("add_scored on totals made with_base");
        b.nll_base.push(f64::from(score.nll_base));
        b.kld.push(score.kld);
        b.p_diff.push(f64::from(score.p_diff));
        b.same_top += usize::from(score.same_top);
        b.identical_rows += usize::from(identical);
    }

    pub fn count(&self) -> usize {
        self.nll.len()
    }

    pub fn summary(&self) -> Summary {
        let n = self.nll.len();
        let (log_ppl, log_ppl_unc) = mean_and_uncertainty(&self.nll);
        let ppl = log_ppl.exp();
        let base = self.against_base.as_ref().map(|b| {
            let (log_ppl_base, log_ppl_base_unc) = mean_and_uncertainty(&b.nll_base);
            let (kld_mean, kld_unc) = mean_and_uncertainty(&b.kld);
            let mut sorted = b.kld.clone();
            sorted.sort_by(f64::total_cmp);
            let squares: Vec<f64> = b.p_diff.iter().map(|d| d * d).collect();
            let (mse, _) = mean_and_uncertainty(&squares);
            AgainstBase {
                ppl_base: log_ppl_base.exp(),
                ppl_base_unc: log_ppl_base.exp() * log_ppl_base_unc,
                ln_ppl_ratio: log_ppl - log_ppl_base,
                kld_mean,
                kld_unc,
                kld_median: percentile(&sorted, 0.5),
                kld_p99: percentile(&sorted, 0.99),
                kld_p999: percentile(&sorted, 0.999),
                kld_max: sorted.last().copied().unwrap_or(0.0),
                rms_dp: mse.sqrt(),
                same_top: b.same_top as f64 / n.max(1) as f64,
                identical_rows: b.identical_rows,
            }
        });
        Summary {
            tokens_scored: n,
            ppl,
            ppl_unc: ppl * log_ppl_unc,
            base,
        }
    }
}

/// What `kvwarden eval` prints (and writes with `--json`).
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub tokens_scored: usize,
    pub ppl: f64,
    pub ppl_unc: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base: Option<AgainstBase>,
}

#[derive(Debug, Clone, Serialize)]
pub struct AgainstBase {
    pub ppl_base: f64,
    pub ppl_base_unc: f64,
    /// ln(PPL / PPL(base)).
    pub ln_ppl_ratio: f64,
    pub kld_mean: f64,
    pub kld_unc: f64,
    pub kld_median: f64,
    pub kld_p99: f64,
    pub kld_p999: f64,
    pub kld_max: f64,
    /// Root mean square of p(next token) − p_base(next token).
    pub rms_dp: f64,
    /// Fraction of positions where both put the same token first.
    pub same_top: f64,
    /// Positions whose stored distribution equals the base's bit for bit.
    pub identical_rows: usize,
}

/// llama-perplexity's mean and its standard error (0 for fewer than 11 values).
fn mean_and_uncertainty(values: &[f64]) -> (f64, f64) {
    let n = values.len();
    if n == 0 {
        return (0.0, 0.0);
    }
    let (sum, sum2) = values
        .iter()
        .fold((0.0, 0.0), |(s, s2), &v| (s + v, s2 + v * v));
    let mean = sum / n as f64;
    let var = sum2 / n as f64 - mean * mean;
    let unc = if var > 0.0 && n > 10 {
        (var / (n - 1) as f64).sqrt()
    } else {
        0.0
    };
    (mean, unc)
}

/// llama-perplexity's percentile: linear between the two nearest sorted values.
fn percentile(sorted: &[f64], fraction: f64) -> f64 {
    match sorted {
        [] => 0.0,
        [only] => *only,
        _ if fraction <= 0.0 => sorted[0],
        _ if fraction >= 1.0 => sorted[sorted.len() - 1],
        _ => {
            let p = fraction * (sorted.len() - 1) as f64;
            let at = p as usize;
            let t = p - at as f64;
            (1.0 - t) * sorted[at] + t * sorted[(at + 1).min(sorted.len() - 1)]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_llama_perplexity() {
        let v: Vec<f64> = (0..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v, 0.995), 99.5);
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&[3.0], 0.99), 3.0);
    }

    #[test]
    fn perplexity_is_exp_of_the_mean_nll() {
        let mut t = Totals::default();
        for v in [1.0f32, 2.0, 3.0] {
            t.add_nll(v);
        }
        let s = t.summary();
        assert_eq!(s.tokens_scored, 3);
        assert!((s.ppl - 2f64.exp()).abs() < 1e-12);
        assert!(s.base.is_none());
    }

    #[test]
    fn base_figures_count_agreement_and_divergence() {
        let mut t = Totals::with_base();
        for i in 0..20 {
            t.add_scored(
                RowScore {
                    nll: 1.0,
                    nll_base: 1.0,
                    kld: if i == 19 { 0.5 } else { 0.0 },
                    same_top: i != 19,
                    p_diff: 0.0,
                },
                i < 10,
            );
        }
        let b = t.summary().base.expect("base");
        assert_eq!(b.identical_rows, 10);
        assert!((b.same_top - 0.95).abs() < 1e-12);
        assert!((b.kld_mean - 0.025).abs() < 1e-12);
        assert_eq!(b.kld_max, 0.5);
        assert_eq!(b.ln_ppl_ratio, 0.0);
    }
}
