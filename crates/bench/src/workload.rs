//! What to send and when: one distinct prompt per request (so no prefix cache can help),
//! and the moments requests start under a Poisson arrival process.

use std::ops::Range;
use std::time::Duration;

use oai_client::{Prompt, Rng};

/// Common words for text prompts: every one is a single token or two in the usual
/// vocabularies, so N words is roughly N to 2N tokens.
const WORDS: &[&str] = &[
    "the", "house", "river", "light", "water", "story", "people", "city", "music", "table",
    "morning", "garden", "window", "letter", "school", "market", "forest", "winter", "paper",
    "bridge", "mountain", "friend", "animal", "summer", "engine", "number", "language", "history",
    "road", "field", "island", "kitchen", "doctor", "village", "ocean", "travel", "silver",
    "question", "answer", "moment", "family", "country", "evening", "station", "picture",
    "problem", "machine", "teacher",
];

/// How prompts are made.
#[derive(Debug, Clone)]
pub enum PromptSpec {
    /// Random token ids drawn from `ids` (a range clear of special and control tokens), sent
    /// as a list: exact lengths, no tokenizer needed.
    Tokens { len: usize, ids: Range<u32> },
    /// Random common words, sent as text.
    Words { len: usize },
    /// A passage of random common words to repeat, sent as text.
    Repeat { len: usize },
}

impl PromptSpec {
    /// Prompt tokens a request of this spec sends, when known without a tokenizer.
    pub fn known_tokens(&self) -> Option<u64> {
        match self {
            PromptSpec::Tokens { len, .. } => Some(*len as u64),
            PromptSpec::Words { .. } | PromptSpec::Repeat { .. } => None,
        }
    }
}

/// One prompt per request; request `i`'s prompt starts differently from every other's.
pub fn prompts(spec: &PromptSpec, n: usize, seed: u64) -> Vec<Prompt> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|i| match spec {
            PromptSpec::Tokens { len, ids } => {
                let span = ids.end.saturating_sub(ids.start).max(1) as usize;
                // The first two ids spell the request's index, so no two prompts share a
                // first page however many requests there are (up to span squared).
                let first = |k: usize| ids.start + (k % span) as u32;
                let mut t = Vec::with_capacity(*len);
                t.extend([first(i), first(i / span)].into_iter().take(*len));
                while t.len() < *len {
                    t.push(ids.start + rng.below(span) as u32);
                }
                Prompt::Tokens(t)
            }
            PromptSpec::Words { len } => {
                let mut s = format!("{i}:");
                for _ in 0..*len {
                    s.push(' ');
                    s.push_str(rng.pick::<&str>(WORDS));
                }
                Prompt::Text(s)
            }
            PromptSpec::Repeat { len } => {
                let passage: Vec<&str> = (0..*len).map(|_| *rng.pick::<&str>(WORDS)).collect();
                Prompt::Text(format!(
                    "Text {i}: {}\n\nRepeat text {i} exactly, word for word:\n{}",
                    passage.join(" "),
                    passage[0]
                ))
            }
        })
        .collect()
}

/// Start offsets of `n` requests arriving as a Poisson process of `rate` per second
/// (exponential gaps), the first at zero.
pub fn poisson_arrivals(n: usize, rate: f64, seed: u64) -> Vec<Duration> {
    // Its own stream, so the prompts of a seed do not depend on whether a rate was given.
    let mut rng = Rng::new(seed ^ 0x5eed_a441_7a1e);
    let mut t = 0.0f64;
    (0..n)
        .map(|i| {
            if i > 0 {
                // Uniform in (0, 1]: 53 random bits, never zero, so the log is finite.
                let u = ((rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
                t += -u.ln() / rate;
            }
            Duration::from_secs_f64(t)
        })
        .collect()
}

/// Parses `LO..HI` (HI exclusive) or `LO-HI`.
pub fn parse_id_range(s: &str) -> Result<Range<u32>, String> {
    let (lo, hi) = s
        .split_once("..")
        .or_else(|| s.split_once('-'))
        .ok_or_else(|| format!("expected LO..HI, got {s:?}"))?;
    let num = |v: &str| {
        v.trim()
            .parse::<u32>()
            .map_err(|e| format!("{v:?} in {s:?}: {e}"))
    };
    let (lo, hi) = (num(lo)?, num(hi)?);
    if lo >= hi {
        return Err(format!("empty token id range {lo}..{hi}"));
    }
    Ok(lo..hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_prompts_are_exact_distinct_and_in_range() {
        let spec = PromptSpec::Tokens {
            len: 50,
            ids: 1000..1020,
        };
        let ps = prompts(&spec, 200, 7);
        let mut firsts = std::collections::HashSet::new();
        for p in &ps {
            let Prompt::Tokens(t) = p else {
                panic!("expected token ids")
            };
            assert_eq!(t.len(), 50);
            assert!(t.iter().all(|id| (1000..1020).contains(id)));
            firsts.insert((t[0], t[1]));
        }
        assert_eq!(firsts.len(), 200, "two prompts share their first two ids");
        // Seeded: the same seed gives the same prompts, another seed others.
        let again = prompts(&spec, 200, 7);
        let other = prompts(&spec, 200, 8);
        let ids = |v: &[Prompt]| format!("{v:?}");
        assert_eq!(ids(&ps), ids(&again));
        assert_ne!(ids(&ps), ids(&other));
        // A prompt shorter than the index prefix is still exactly that long.
        let one = prompts(&PromptSpec::Tokens { len: 1, ids: 5..9 }, 3, 0);
        assert!(one
            .iter()
            .all(|p| matches!(p, Prompt::Tokens(t) if t.len() == 1)));
    }

    #[test]
    fn repeat_prompts_hold_their_passage_and_begin_its_repetition() {
        let ps = prompts(&PromptSpec::Repeat { len: 20 }, 3, 1);
        for (i, p) in ps.iter().enumerate() {
            let Prompt::Text(t) = p else {
                panic!("expected text")
            };
            let (head, ask) = t.split_once("\n\n").unwrap();
            let passage = head.strip_prefix(&format!("Text {i}: ")).unwrap();
            assert_eq!(passage.split(' ').count(), 20);
            assert!(ask.ends_with(passage.split(' ').next().unwrap()));
        }
    }

    #[test]
    fn text_prompts_differ_and_have_the_words_asked_for() {
        let ps = prompts(&PromptSpec::Words { len: 12 }, 3, 1);
        for (i, p) in ps.iter().enumerate() {
            let Prompt::Text(t) = p else {
                panic!("expected text")
            };
            assert!(t.starts_with(&format!("{i}:")));
            assert_eq!(t.split(' ').count(), 13);
        }
    }

    #[test]
    fn poisson_gaps_average_one_over_the_rate() {
        let a = poisson_arrivals(20_000, 4.0, 3);
        assert_eq!(a[0], Duration::ZERO);
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
        let mean_gap = a[a.len() - 1].as_secs_f64() / (a.len() - 1) as f64;
        assert!((mean_gap - 0.25).abs() < 0.01, "mean gap {mean_gap}");
    }

    #[test]
    fn id_ranges_parse_and_refuse_nonsense() {
        assert_eq!(parse_id_range("1000..10000"), Ok(1000..10000));
        assert_eq!(parse_id_range("3-9"), Ok(3..9));
        assert!(parse_id_range("9..3").is_err());
        assert!(parse_id_range("x..3").is_err());
        assert!(parse_id_range("12").is_err());
    }
}
