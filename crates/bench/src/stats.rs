//! Summaries of latency samples.

use std::time::Duration;

/// Mean and percentiles of one latency, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Dist {
    pub samples: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Dist {
    /// `None` when there are no samples (a latency nothing measured is not zero).
    pub fn of(samples: &[Duration]) -> Option<Dist> {
        if samples.is_empty() {
            return None;
        }
        let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        Some(Dist {
            samples: ms.len(),
            mean: ms.iter().sum::<f64>() / ms.len() as f64,
            p50: percentile(&ms, 50.0),
            p90: percentile(&ms, 90.0),
            p99: percentile(&ms, 99.0),
            max: ms[ms.len() - 1],
        })
    }
}

/// Linear interpolation between the closest ranks (numpy's default), over sorted values:
/// monotone in `p`, so p50 <= p90 <= p99 always.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&m| Duration::from_millis(m)).collect()
    }

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let d = Dist::of(&ms(&[40, 10, 30, 20, 50])).expect("samples");
        assert_eq!((d.samples, d.mean, d.p50, d.max), (5, 30.0, 30.0, 50.0));
        assert!((d.p90 - 46.0).abs() < 1e-9, "{}", d.p90);
        assert!((d.p99 - 49.6).abs() < 1e-9, "{}", d.p99);
        let one = Dist::of(&ms(&[7])).expect("one sample");
        assert_eq!((one.p50, one.p99), (7.0, 7.0));
        assert_eq!(Dist::of(&[]), None);
    }
}
