//! One position's next-token distribution as llama.cpp stores it, and the per-position
//! scores: negative log-likelihood, KL divergence, top-1 agreement, Δp.
//!
//! The arithmetic follows `tools/perplexity/perplexity.cpp` of llama.cpp 0.3.36 step for
//! step (the f32 and f64 operations in its order, glibc's `expf` and `log` as it calls
//! them), so the same logits give the same stored bytes as llama-perplexity writes, and the
//! same scores as it prints.

/// Log-probabilities clamped from below at `max − 16` and quantized to 16 bits:
/// `log p_i ≈ scale · q_i + min_log_prob`.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredRow {
    pub scale: f32,
    pub min_log_prob: f32,
    pub q: Vec<u16>,
}

/// Where a stored distribution stops counting a token: llama.cpp's KL divergence sums over
/// the base's tokens with log p above this.
const KL_LOG_P_FLOOR: f32 = -16.0;

/// llama.cpp's `nearest_int`: round to nearest (ties to even) by the 1.5 · 2^23 trick, for
/// values well inside ±2^22.
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0f32).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// The maximum (first index on ties, as `std::max` in a loop keeps) and minimum of a row.
fn max_min(logits: &[f32]) -> (f32, usize, f32) {
    let (mut max, mut imax, mut min) = (logits[0], 0, logits[0]);
    for (i, &v) in logits.iter().enumerate().skip(1) {
        if v > max {
            max = v;
            imax = i;
        }
        if v < min {
            min = v;
        }
    }
    (max, imax, min)
}

/// `log Σ exp(l_i − max)`: f32 exponentials summed in f64, the log taken in f64 and
/// rounded to f32, as llama.cpp does.
fn log_sum_exp(logits: &[f32], max: f32) -> f32 {
    let mut sum = 0f64;
    for &v in logits {
        sum += f64::from((v - max).exp());
    }
    sum.ln() as f32
}

/// Negative log-likelihood of `tok` under raw logits (llama-perplexity's value, f32).
pub fn nll(logits: &[f32], tok: usize) -> f32 {
    let (max, _, _) = max_min(logits);
    let lse = log_sum_exp(logits, max);
    max + lse - logits[tok]
}

impl StoredRow {
    /// u16 per stored row of a vocabulary: two f32, then the tokens padded to an even count.
    pub fn len_for(n_vocab: usize) -> usize {
        2 * n_vocab.div_ceil(2) + 4
    }

    /// llama-perplexity's stored form of raw logits.
    pub fn from_logits(logits: &[f32]) -> Self {
        let (max, _, min) = max_min(logits);
        let min = if min < max - 16.0 { max - 16.0 } else { min };
        let lse = log_sum_exp(logits, max);
        let min_log_prob = min - max - lse;
        let scale = (max - min) / 65535.0;
        let q = if scale != 0.0 {
            let inv = 1.0 / scale;
            logits
                .iter()
                .map(|&v| {
                    if v > min {
                        nearest_int(inv * (v - min)) as u16
                    } else {
                        0
                    }
                })
                .collect()
        } else {
            vec![0; logits.len()]
        };
        Self {
            scale,
            min_log_prob,
            q,
        }
    }

    /// Reads one row of `len_for(n_vocab)` u16 (little-endian bytes).
    pub fn from_le_bytes(raw: &[u8], n_vocab: usize) -> Self {
        let f = |at: usize| f32::from_le_bytes([raw[at], raw[at + 1], raw[at + 2], raw[at + 3]]);
        let q = raw[8..8 + 2 * n_vocab]
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        Self {
            scale: f(0),
            min_log_prob: f(4),
            q,
        }
    }

    /// Appends the row's bytes, padding included (zeros, as llama.cpp leaves them).
    pub fn write_le_bytes(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.scale.to_le_bytes());
        out.extend_from_slice(&self.min_log_prob.to_le_bytes());
        for &v in &self.q {
            out.extend_from_slice(&v.to_le_bytes());
        }
        if self.q.len() % 2 == 1 {
            out.extend_from_slice(&[0, 0]);
        }
    }

    /// The stored log-probability of token `i`.
    pub fn log_p(&self, i: usize) -> f32 {
        self.scale * f32::from(self.q[i]) + self.min_log_prob
    }

    /// The most probable token as stored (the first on ties).
    pub fn argmax(&self) -> usize {
        let mut best = 0;
        for (i, &v) in self.q.iter().enumerate().skip(1) {
            if v > self.q[best] {
                best = i;
            }
        }
        best
    }
}

/// One scored position against a stored base distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowScore {
    /// −log p(next token) under the distribution judged.
    pub nll: f32,
    /// The same under the base.
    pub nll_base: f32,
    /// KL(base ‖ judged) in nats.
    pub kld: f64,
    /// Whether both put the same token first.
    pub same_top: bool,
    /// p(next token) judged − p(next token) base.
    pub p_diff: f32,
}

/// Raw logits against a stored base, exactly as llama-perplexity's `--kl-divergence` scores
/// them.
pub fn score_logits(logits: &[f32], base: &StoredRow, tok: usize) -> RowScore {
    let (max, imax, _) = max_min(logits);
    let lse = log_sum_exp(logits, max);
    let nll = max + lse - logits[tok];
    let nll_base = -base.log_p(tok);
    let norm = max + lse;
    let mut kld = 0f64;
    for (i, &l) in logits.iter().enumerate() {
        let lb = base.log_p(i);
        if lb > KL_LOG_P_FLOOR {
            kld += f64::from(lb.exp() * (lb - l + norm));
        }
    }
    finish(nll, nll_base, kld, imax == base.argmax())
}

/// A stored distribution against a stored base. Both are log-probabilities already, so
/// neither is renormalized: identical rows score a KL divergence of exactly 0, which is what
/// comparing two builds or two CPU paths through their files must show.
pub fn score_stored(judged: &StoredRow, base: &StoredRow, tok: usize) -> RowScore {
    let nll = -judged.log_p(tok);
    let nll_base = -base.log_p(tok);
    let mut kld = 0f64;
    for i in 0..base.q.len() {
        let lb = base.log_p(i);
        if lb > KL_LOG_P_FLOOR {
            kld += f64::from(lb.exp() * (lb - judged.log_p(i)));
        }
    }
    finish(nll, nll_base, kld, judged.argmax() == base.argmax())
}

fn finish(nll: f32, nll_base: f32, kld: f64, same_top: bool) -> RowScore {
    RowScore {
        nll,
        nll_base,
        kld,
        same_top,
        p_diff: (-nll).exp() - (-nll_base).exp(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits(seed: u32, n: usize) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 20_000) as f32 / 1000.0 - 10.0
            })
            .collect()
    }

    #[test]
    fn nearest_int_rounds_half_to_even_like_lrintf() {
        for (v, want) in [(0.4f32, 0), (0.5, 0), (1.5, 2), (2.5, 2), (65534.6, 65535)] {
            assert_eq!(nearest_int(v), want, "{v}");
        }
        for i in 0..100_000 {
            let v = i as f32 * 0.65537;
            assert_eq!(nearest_int(v), v.round_ties_even() as i32, "{v}");
        }
    }

    #[test]
    fn stored_row_spans_the_top_sixteen_nats() {
        let l = logits(1, 1001);
        let row = StoredRow::from_logits(&l);
        let (max, imax, _) = max_min(&l);
        assert_eq!(row.q[imax], 65535);
        assert_eq!(row.argmax(), imax);
        let lse = log_sum_exp(&l, max);
        for (i, &v) in l.iter().enumerate() {
            let exact = v - max - lse;
            if exact > max - 16.0 - max - lse {
                assert!(
                    (row.log_p(i) - exact).abs() <= row.scale,
                    "token {i}: {} vs {exact}",
                    row.log_p(i)
                );
            } else {
                assert_eq!(row.q[i], 0);
            }
        }
        let mut bytes = Vec::new();
        row.write_le_bytes(&mut bytes);
        assert_eq!(bytes.len(), 2 * StoredRow::len_for(1001));
        assert_eq!(StoredRow::from_le_bytes(&bytes, 1001), row);
    }

    #[test]
    fn identical_distributions_score_zero_and_different_ones_do_not() {
        let a = logits(2, 500);
        let row = StoredRow::from_logits(&a);
        let same = score_stored(&row, &row, 7);
        assert_eq!(same.kld, 0.0);
        assert!(same.same_top);
        assert_eq!(same.p_diff, 0.0);
        // Raw logits against their own stored form: only the 16-bit rounding is left (a
        // step of 16/65535 nats at most).
        let own = score_logits(&a, &row, 7);
        assert!(own.kld.abs() < 1e-4, "{}", own.kld);
        assert!(own.same_top);

        let mut b = a.clone();
        let top = row.argmax();
        b[top] -= 5.0;
        let moved = score_logits(&b, &row, top);
        assert!(moved.kld > 0.01, "{}", moved.kld);
        assert!(!moved.same_top);
        assert!(moved.nll > own.nll && moved.p_diff < 0.0);
        let moved_stored = score_stored(&StoredRow::from_logits(&b), &row, top);
        assert!((moved_stored.kld - moved.kld).abs() < 1e-3 * moved.kld.max(1.0));
    }

    #[test]
    fn nll_is_minus_log_softmax() {
        let l = logits(3, 300);
        let max = l.iter().copied().fold(f32::MIN, f32::max) as f64;
        let z: f64 = l.iter().map(|&v| (v as f64 - max).exp()).sum();
        for tok in [0, 17, 299] {
            let exact = max + z.ln() - l[tok] as f64;
            assert!((f64::from(nll(&l, tok)) - exact).abs() < 1e-5);
        }
    }
}
