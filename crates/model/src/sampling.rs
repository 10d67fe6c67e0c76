//! Turning logits into tokens: greedy, or temperature with top-k / top-p under a seeded
//! generator (same seed, same tokens).

/// How to pick the next token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 1.0 disables nucleus filtering.
    pub top_p: f32,
    /// 0 disables top-k filtering.
    pub top_k: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

/// The highest logit; the lowest id among equals, so ties are deterministic.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Natural-log probabilities of the raw (temperature 1) distribution.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max + sum.ln() as f32;
    logits.iter().map(|&l| l - lse).collect()
}

/// The `k` most likely tokens with their log-probabilities, most likely first.
pub fn top_logprobs(logprobs: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..logprobs.len() as u32).collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    idx.select_nth_unstable_by(k - 1, |&a, &b| {
        logprobs[b as usize]
            .total_cmp(&logprobs[a as usize])
            .then(a.cmp(&b))
    });
    idx.truncate(k);
    idx.sort_by(|&a, &b| {
        logprobs[b as usize]
            .total_cmp(&logprobs[a as usize])
            .then(a.cmp(&b))
    });
    idx.into_iter().map(|i| (i, logprobs[i as usize])).collect()
}

/// A seeded sampler (xoshiro256**, seeded through splitmix64).
pub struct Sampler {
    params: SamplingParams,
    state: [u64; 4],
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let mut sm = params.seed;
        let mut next = || {
            sm = sm.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = sm;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let state = [next(), next(), next(), next()];
        Self { params, state }
    }

    /// The generator's position, so that another node can go on sampling exactly where
    /// this one stopped (a prefill node samples the first token, a decode node the rest).
    pub fn state(&self) -> [u64; 4] {
        self.state
    }

    /// A sampler with `params` at a position that [`Sampler::state`] reported.
    pub fn resume(params: SamplingParams, state: [u64; 4]) -> Self {
        Self { params, state }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.state;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = self.params;
        if p.temperature <= 0.0 || p.top_k == 1 {
            return argmax(logits);
        }
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .collect();
        // A total order (ties by id), so selecting the top k first and sorting only them
        // gives the same list as sorting everything: with Gemma's 262,144 tokens a full sort
        // per token costs more than the selection.
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, order);
            cand.truncate(p.top_k);
        }
        cand.sort_by(order);
        let max = cand[0].1;
        let mut probs: Vec<f64> = cand
            .iter()
            .map(|&(_, l)| ((l - max) as f64).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        for pr in probs.iter_mut() {
            *pr /= total;
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, pr) in probs.iter().enumerate() {
                acc += pr;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            cand.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut r = self.next_f64() * total;
        for (i, pr) in probs.iter().enumerate() {
            r -= pr;
            if r < 0.0 {
                return cand[i].0;
            }
        }
        cand[probs.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.0, -1.0, 5.0]), 2);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 3,
            seed: 42,
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(params);
            (0..100).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(params);
            (0..100).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        // top-3 of logits with value 1.8 (i % 7 == 6): ids 6, 13, 20.
        assert!(a.iter().all(|t| [6, 13, 20].contains(t)), "{a:?}");
        assert!(a.iter().any(|&t| t != a[0]), "sampling never varied");
    }

    #[test]
    fn a_resumed_sampler_continues_the_same_sequence() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 5) as f32 * 0.2).collect();
        let params = SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            top_k: 0,
            seed: 9,
        };
        let mut whole = Sampler::new(params);
        let expected: Vec<u32> = (0..40).map(|_| whole.sample(&logits)).collect();
        let mut first = Sampler::new(params);
        let head = first.sample(&logits);
        let mut rest = Sampler::resume(params, first.state());
        let mut got = vec![head];
        got.extend((1..40).map(|_| rest.sample(&logits)));
        assert_eq!(got, expected);
        // A fresh sampler would not have continued it.
        let mut fresh = Sampler::new(params);
        let restarted: Vec<u32> = (1..40).map(|_| fresh.sample(&logits)).collect();
        assert_ne!(restarted[..], expected[1..]);
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        let logits = [10.0, 0.0, 0.0, 0.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            top_k: 0,
            seed: 1,
        });
        assert!((0..50).all(|_| s.sample(&logits) == 0));
    }

    #[test]
    fn logprobs_normalize() {
        let lp = log_softmax(&[1.0, 2.0, 3.0]);
        let total: f32 = lp.iter().map(|l| l.exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        let top = top_logprobs(&lp, 2);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
    }
}
