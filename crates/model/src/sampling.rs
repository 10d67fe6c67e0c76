//! Turning logits into tokens: greedy, or temperature with top-k / top-p / min-p under a
//! seeded generator (same seed, same tokens), after the request's logit bias and
//! repetition penalties.
//!
//! The adjustments read only the row's own history (its prompt and the tokens it has
//! produced), never another row's and never the generator: a row samples the same token
//! alone or in any batch, and a decode node that holds the prompt and the prefill node's
//! first token samples exactly as a single node would, with no penalty state to hand over.
//! In order, on the raw logits of one position:
//!
//! 1. `logit_bias`: `l[t] += bias[t]`;
//! 2. repetition (llama.cpp's `repeat_penalty`, Hugging Face's `repetition_penalty`): each
//!    distinct token among the last `repeat_last_n` of prompt ++ output has a positive
//!    logit divided by the penalty, a negative (or zero) one multiplied by it;
//! 3. frequency and presence (OpenAI's definitions, over this answer's tokens only):
//!    `l[t] -= count[t] * frequency + (count[t] > 0) * presence`;
//!
//! then greedy takes the highest adjusted logit; sampling divides by the temperature,
//! keeps the top k, drops tokens less likely than `min_p` times the most likely one, keeps
//! the nucleus of mass `top_p`, and draws. Reported log-probabilities are the model's own
//! (before any of this), as vLLM's default `raw_logprobs` reports them.

use std::sync::Arc;

/// How to pick the next token.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 1.0 disables nucleus filtering.
    pub top_p: f32,
    /// 0 disables top-k filtering.
    pub top_k: usize,
    /// 0 disables; otherwise in (0, 1].
    pub min_p: f32,
    pub seed: u64,
    pub penalties: Penalties,
    /// Added to the logits of these tokens, sorted by token id, each id once.
    pub logit_bias: Arc<[(u32, f32)]>,
    /// Tokens that end the answer besides the model's own end-of-generation tokens (vLLM's
    /// `stop_token_ids`), sorted, each once. The engine applies them.
    pub stop_tokens: Arc<[u32]>,
    /// The answer's fewest tokens: until it has this many, no token that would end it may
    /// be chosen (vLLM's `min_tokens`; 0 disables). The engine applies it.
    pub min_tokens: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: 0,
            penalties: Penalties::default(),
            logit_bias: Arc::from([]),
            stop_tokens: Arc::from([]),
            min_tokens: 0,
        }
    }
}

/// Penalties on tokens the row has already seen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    /// Subtracted once from every token that occurs in the output so far.
    pub presence: f32,
    /// Subtracted per occurrence in the output so far.
    pub frequency: f32,
    /// 1.0 disables.
    pub repetition: f32,
    /// How many of the last tokens (prompt ++ output) the repetition penalty looks at;
    /// `usize::MAX` is all of them.
    pub repeat_last_n: usize,
}

impl Default for Penalties {
    fn default() -> Self {
        Self {
            presence: 0.0,
            frequency: 0.0,
            repetition: 1.0,
            // llama.cpp's default window.
            repeat_last_n: 64,
        }
    }
}

impl Penalties {
    fn is_active(&self) -> bool {
        self.presence != 0.0
            || self.frequency != 0.0
            || (self.repetition != 1.0 && self.repeat_last_n > 0)
    }
}

/// What a row has seen: its prompt and the tokens it has produced so far.
#[derive(Debug, Clone, Copy, Default)]
pub struct History<'a> {
    pub prompt: &'a [u32],
    pub output: &'a [u32],
}

impl SamplingParams {
    fn adjusts_logits(&self) -> bool {
        !self.logit_bias.is_empty() || self.penalties.is_active()
    }

    /// The logits after the bias and the penalties (steps 1 to 3 of the module docs).
    /// Token ids outside `logits` are ignored: validation refuses them before this.
    pub fn adjusted_logits(&self, logits: &[f32], history: History<'_>) -> Vec<f32> {
        let mut out = logits.to_vec();
        for &(id, bias) in self.logit_bias.iter() {
            if let Some(l) = out.get_mut(id as usize) {
                *l += bias;
            }
        }
        let p = self.penalties;
        if p.repetition != 1.0 && p.repeat_last_n > 0 {
            let total = history.prompt.len() + history.output.len();
            let skip = total.saturating_sub(p.repeat_last_n);
            let mut seen: Vec<u32> = history
                .prompt
                .iter()
                .chain(history.output)
                .skip(skip)
                .copied()
                .collect();
            seen.sort_unstable();
            seen.dedup();
            for id in seen {
                if let Some(l) = out.get_mut(id as usize) {
                    *l = if *l <= 0.0 {
                        *l * p.repetition
                    } else {
                        *l / p.repetition
                    };
                }
            }
        }
        if p.presence != 0.0 || p.frequency != 0.0 {
            let mut counted: Vec<u32> = history.output.to_vec();
            counted.sort_unstable();
            for run in counted.chunk_by(|a, b| a == b) {
                if let Some(l) = out.get_mut(run[0] as usize) {
                    *l -= run.len() as f32 * p.frequency + p.presence;
                }
            }
        }
        out
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

/// [`argmax`] over the tokens whose bit is set in `allowed` (lowest id among equals); 0
/// when none is.
fn argmax_allowed(logits: &[f32], allowed: &[u32]) -> u32 {
    let mut best: Option<usize> = None;
    for (w, &word) in allowed.iter().enumerate() {
        let mut rest = word;
        while rest != 0 {
            let i = w * 32 + rest.trailing_zeros() as usize;
            rest &= rest - 1;
            let Some(&l) = logits.get(i) else { break };
            if best.is_none_or(|b| l > logits[b]) {
                best = Some(i);
            }
        }
    }
    best.unwrap_or(0) as u32
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

    /// The next token of a row that has seen `history`.
    pub fn sample(&mut self, logits: &[f32], history: History<'_>) -> u32 {
        self.pick(logits, history, None)
    }

    /// The next token among those `allowed` (a structured output's mask, a bitset: token
    /// `t` is bit `t % 32` of word `t / 32`; it must allow at least one token of `logits`):
    /// every other token is removed before any step above, so greedy takes the best
    /// allowed token and sampling draws from the allowed ones alone.
    pub fn sample_allowed(&mut self, logits: &[f32], history: History<'_>, allowed: &[u32]) -> u32 {
        self.pick(logits, history, Some(allowed))
    }

    fn pick(&mut self, logits: &[f32], history: History<'_>, allowed: Option<&[u32]>) -> u32 {
        let greedy = self.params.temperature <= 0.0 || self.params.top_k == 1;
        if let (Some(bits), true, false) = (allowed, greedy, self.params.adjusts_logits()) {
            // The common case of a constrained row costs no copy of the logits.
            return argmax_allowed(logits, bits);
        }
        let adjusted;
        let logits = if self.params.adjusts_logits() || allowed.is_some() {
            let mut a = self.params.adjusted_logits(logits, history);
            if let Some(bits) = allowed {
                for (w, chunk) in a.chunks_mut(32).enumerate() {
                    let word = bits.get(w).copied().unwrap_or(0);
                    if word == u32::MAX {
                        continue;
                    }
                    for (b, l) in chunk.iter_mut().enumerate() {
                        if word & (1 << b) == 0 {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                }
            }
            adjusted = a;
            &adjusted[..]
        } else {
            logits
        };
        let p = &self.params;
        if p.temperature <= 0.0 || p.top_k == 1 {
            return argmax(logits);
        }
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|&(_, &l)| l > f32::NEG_INFINITY)
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .collect();
        if cand.is_empty() {
            return argmax(logits);
        }
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
        if p.min_p > 0.0 {
            // probs[0] is the most likely; the list is sorted, so the kept ones are a prefix.
            let floor = p.min_p as f64 * probs[0];
            let keep = probs.iter().take_while(|&&pr| pr >= floor).count().max(1);
            probs.truncate(keep);
            cand.truncate(keep);
            let total: f64 = probs.iter().sum();
            for pr in probs.iter_mut() {
                *pr /= total;
            }
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
    fn a_mask_removes_tokens_before_greedy_and_sampling() {
        let logits = [5.0, 1.0, 4.0, 3.0, -2.0];
        let odd = [0b01010u32];
        let mut greedy = Sampler::new(SamplingParams::default());
        assert_eq!(greedy.sample(&logits, History::default()), 0);
        assert_eq!(greedy.sample_allowed(&logits, History::default(), &odd), 3);
        // With an adjustment, the copying path gives the same choice.
        let mut biased = Sampler::new(SamplingParams {
            logit_bias: std::sync::Arc::from([(1, 0.5)]),
            ..Default::default()
        });
        assert_eq!(biased.sample_allowed(&logits, History::default(), &odd), 3);
        // Beyond one word, and ties to the lowest allowed id.
        let wide: Vec<f32> = (0..70)
            .map(|i| if i == 40 || i == 66 { 9.0 } else { 0.0 })
            .collect();
        let mut bits = [0u32; 3];
        for t in [3, 40, 66, 69] {
            bits[t / 32] |= 1 << (t % 32);
        }
        assert_eq!(greedy.sample_allowed(&wide, History::default(), &bits), 40);
        for seed in 0..200 {
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.5,
                top_k: 3,
                top_p: 0.99,
                seed,
                ..Default::default()
            });
            // top-k counts allowed tokens only: 1 and 3 (and nothing masked fills a place).
            let t = s.sample_allowed(&logits, History::default(), &odd);
            assert!(t == 1 || t == 3, "seed {seed}: {t}");
        }
        let only_last = [0b10000u32];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            ..Default::default()
        });
        assert_eq!(s.sample_allowed(&logits, History::default(), &only_last), 4);
    }

    #[test]
    fn greedy_and_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.0, -1.0, 5.0], History::default()), 2);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 3,
            seed: 42,
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(params.clone());
            (0..100)
                .map(|_| s.sample(&logits, History::default()))
                .collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(params.clone());
            (0..100)
                .map(|_| s.sample(&logits, History::default()))
                .collect()
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
            ..Default::default()
        };
        let mut whole = Sampler::new(params.clone());
        let expected: Vec<u32> = (0..40)
            .map(|_| whole.sample(&logits, History::default()))
            .collect();
        let mut first = Sampler::new(params.clone());
        let head = first.sample(&logits, History::default());
        let mut rest = Sampler::resume(params.clone(), first.state());
        let mut got = vec![head];
        got.extend((1..40).map(|_| rest.sample(&logits, History::default())));
        assert_eq!(got, expected);
        // A fresh sampler would not have continued it.
        let mut fresh = Sampler::new(params.clone());
        let restarted: Vec<u32> = (1..40)
            .map(|_| fresh.sample(&logits, History::default()))
            .collect();
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
            ..Default::default()
        });
        assert!((0..50).all(|_| s.sample(&logits, History::default()) == 0));
    }

    #[test]
    fn logprobs_normalize() {
        let lp = log_softmax(&[1.0, 2.0, 3.0]);
        let total: f32 = lp.iter().map(|l| l.exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        let top = top_logprobs(&lp, 2);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
    }

    fn history<'a>(prompt: &'a [u32], output: &'a [u32]) -> History<'a> {
        History { prompt, output }
    }

    #[test]
    fn logit_bias_moves_the_greedy_choice() {
        let logits = [1.0, 3.0, 2.0];
        let mut s = Sampler::new(SamplingParams {
            logit_bias: Arc::from([(0, 5.0), (1, -100.0)]),
            ..Default::default()
        });
        assert_eq!(s.sample(&logits, History::default()), 0);
        let mut s = Sampler::new(SamplingParams {
            logit_bias: Arc::from([(1, -1.5)]),
            ..Default::default()
        });
        // 3 - 1.5 < 2.
        assert_eq!(s.sample(&logits, History::default()), 2);
    }

    #[test]
    fn frequency_and_presence_count_the_output_only() {
        let p = SamplingParams {
            penalties: Penalties {
                presence: 0.5,
                frequency: 0.25,
                ..Default::default()
            },
            ..Default::default()
        };
        let logits = [1.0, 1.0, 1.0, 1.0];
        // Token 3 is in the prompt: no frequency or presence penalty for it.
        let got = p.adjusted_logits(&logits, history(&[3, 3], &[1, 2, 1]));
        assert_eq!(
            got,
            vec![1.0, 1.0 - 2.0 * 0.25 - 0.5, 1.0 - 0.25 - 0.5, 1.0]
        );
    }

    #[test]
    fn repetition_divides_positive_and_multiplies_negative_logits_in_its_window() {
        let p = SamplingParams {
            penalties: Penalties {
                repetition: 2.0,
                repeat_last_n: 3,
                ..Default::default()
            },
            ..Default::default()
        };
        let logits = [4.0, -4.0, 4.0, 4.0, 0.0];
        // Window: the last 3 of [0, 1] ++ [2, 1]: tokens 1 and 2 (1 twice, penalized once).
        let got = p.adjusted_logits(&logits, history(&[0, 1], &[2, 1]));
        assert_eq!(got, vec![4.0, -8.0, 2.0, 4.0, 0.0]);
        let all = SamplingParams {
            penalties: Penalties {
                repeat_last_n: usize::MAX,
                ..p.penalties
            },
            ..Default::default()
        };
        let got = all.adjusted_logits(&logits, history(&[0, 1], &[2, 1]));
        assert_eq!(got, vec![2.0, -8.0, 2.0, 4.0, 0.0]);
    }

    #[test]
    fn the_penalties_change_greedy_decoding() {
        let logits = [2.0, 1.9, 0.0];
        let mut s = Sampler::new(SamplingParams {
            penalties: Penalties {
                frequency: 0.2,
                ..Default::default()
            },
            ..Default::default()
        });
        assert_eq!(s.sample(&logits, history(&[], &[])), 0);
        assert_eq!(s.sample(&logits, history(&[], &[0])), 1);
        // Without penalties the history changes nothing.
        let mut plain = Sampler::new(SamplingParams::default());
        assert_eq!(plain.sample(&logits, history(&[0, 0], &[0, 0])), 0);
    }

    #[test]
    fn min_p_drops_the_unlikely_tail() {
        // p ∝ e^0, e^-1, e^-5: with min_p 0.2 only the first two survive (e^-1 ≈ 0.37).
        let logits = [0.0, -1.0, -5.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 0.2,
            seed: 3,
            ..Default::default()
        });
        let draws: Vec<u32> = (0..400)
            .map(|_| s.sample(&logits, History::default()))
            .collect();
        assert!(draws.iter().all(|&t| t < 2), "{draws:?}");
        assert!(draws.contains(&1));
        let mut wide = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 3,
            ..Default::default()
        });
        let draws: Vec<u32> = (0..2000)
            .map(|_| wide.sample(&logits, History::default()))
            .collect();
        assert!(
            draws.contains(&2),
            "without min_p the tail is drawn sometimes"
        );
    }
}
