//! Prompt text and token ids the checks send.

use crate::canary::Canary;
use oai_client::Rng;

/// Ordinary words for filler text: common enough to be single tokens in most vocabularies.
const WORDS: &[&str] = &[
    "river", "garden", "window", "market", "winter", "silver", "engine", "harbor", "forest",
    "letter", "planet", "bridge", "candle", "mirror", "valley", "button", "castle", "rocket",
    "pencil", "shadow", "meadow", "island", "ticket", "basket", "tunnel", "lantern", "anchor",
    "blanket", "compass", "harvest", "library", "morning", "orchard", "pattern", "quarter",
    "station", "thunder", "village", "weather", "blue", "green", "quiet", "early", "simple",
    "gentle", "bright", "narrow", "heavy", "sudden", "open", "walks", "carries", "follows",
    "holds", "finds", "builds", "paints", "reads", "counts", "watches", "the", "a", "near",
    "under", "behind", "across", "with", "and", "while", "because",
];

/// Token ids used for prompts given as ids. Low ids are byte or single-character tokens in
/// byte-level vocabularies (GPT-2 style, llama's byte fallback, kvwarden's synthetic models)
/// and ordinary tokens elsewhere; ids 0-99 are avoided because control tokens live there.
pub const TOKEN_IDS: std::ops::Range<u32> = 100..250;

/// `n` token ids from [`TOKEN_IDS`].
pub fn token_ids(rng: &mut Rng, n: usize) -> Vec<u32> {
    let span = (TOKEN_IDS.end - TOKEN_IDS.start) as usize;
    (0..n)
        .map(|_| TOKEN_IDS.start + rng.below(span) as u32)
        .collect()
}

/// `n` filler words separated by spaces. Every space-separated word is at least one token
/// in any tokenizer that splits on spaces (all common ones), so this is at least `n`
/// tokens: what an over-length prompt needs.
pub fn filler(rng: &mut Rng, n: usize) -> String {
    let mut out = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            out.push(if i % 12 == 0 { '\n' } else { ' ' });
        }
        out.push_str(rng.pick::<&str>(WORDS));
    }
    out
}

/// The canary repeated until the text is about `bytes` long: a pattern the model continues,
/// so any request that decodes over these K/V pages tends to reproduce the canary.
pub fn repeated(canary: &Canary, bytes: usize) -> String {
    let unit = format!("{} ", canary.text());
    let mut out = String::with_capacity(bytes + unit.len());
    while out.len() + unit.len() <= bytes.max(unit.len()) {
        out.push_str(&unit);
    }
    out
}

/// A document of about `words` filler words with the canary at its start, middle and end,
/// and a question about it.
pub fn document(rng: &mut Rng, canary: &Canary, words: usize) -> String {
    let half = words / 2;
    format!(
        "Access code: {c}.\n{a}\nReminder, the access code is {c}.\n{b}\nThe access code was {c}.\nQuestion: what is the access code? Answer:",
        c = canary.text(),
        a = filler(rng, half),
        b = filler(rng, words - half),
    )
}

/// An over-length prompt: at least `min_tokens` tokens of filler, canaries at the start,
/// middle and end. It begins with two spaces, so its first token is a lone space in common
/// tokenizers: a server that wrongly keeps such a request alive on a placeholder made of
/// its first token (the incident's bug) then decodes over stale pages after a token that
/// fits any text, and a small model continues the stale text, canaries included. Measured
/// with the default model and kvwarden's fault-injection build: after a word token the
/// model mostly repeats that word; after a space it echoes the previous tenant's canary.
pub fn over_length(rng: &mut Rng, canary: &Canary, min_tokens: usize) -> String {
    format!("  {}", document(rng, canary, min_tokens))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canary::{CanaryMint, Normalized};

    #[test]
    fn builders_hold_their_canaries_and_sizes() {
        let mut rng = Rng::new(5);
        let c = CanaryMint::new(Rng::new(6)).mint();
        let r = repeated(&c, 400);
        assert!(
            r.len() <= 400 && r.len() > 400 - c.text().len() - 2,
            "{}",
            r.len()
        );
        assert!(c.found_in(&Normalized::new(&r)).is_some());
        let d = over_length(&mut rng, &c, 300);
        assert!(d.starts_with("  ") && !d.starts_with("   "));
        assert!(d.split_whitespace().count() >= 300);
        assert_eq!(d.matches(&c.digits).count(), 3);
        let ids = token_ids(&mut rng, 50);
        assert_eq!(ids.len(), 50);
        assert!(ids.iter().all(|t| TOKEN_IDS.contains(t)));
    }
}
