//! Canaries: unique random strings planted in prompts. Finding one request's canary in any
//! byte that another request received is a leak.

use std::collections::HashSet;

use oai_client::Rng;

const CONSONANTS: &[u8] = b"bdfgjklmnprstvz";
const VOWELS: &[u8] = b"aeiou";

/// One request's secret: a made-up word and a digit string. Both are long enough that a
/// model cannot produce them by chance, and neither appears in any other request.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Canary {
    pub word: String,
    pub digits: String,
}

impl Canary {
    /// The canary as it appears in prompts.
    pub fn text(&self) -> String {
        format!("{} {}", self.word, self.digits)
    }

    /// Which part of this canary `haystack` contains, if any. Matching ignores case and
    /// everything but letters and digits, so "Dukamobo-ri 7702 1190..." still counts.
    pub fn found_in(&self, haystack: &Normalized) -> Option<&str> {
        if haystack.0.contains(&normalize(&self.digits)) {
            Some(&self.digits)
        } else if haystack.0.contains(&normalize(&self.word)) {
            Some(&self.word)
        } else {
            None
        }
    }
}

/// Text reduced to lowercase letters and digits, for canary matching.
#[derive(Debug, Clone, Default)]
pub struct Normalized(String);

impl Normalized {
    pub fn new(text: &str) -> Self {
        Self(normalize(text))
    }
}

fn normalize(text: &str) -> String {
    text.chars()
        .filter(|c| c.is_alphanumeric())
        .flat_map(char::to_lowercase)
        .collect()
}

/// Hands out canaries that are unique within one audit.
#[derive(Debug)]
pub struct CanaryMint {
    rng: Rng,
    seen: HashSet<String>,
}

impl CanaryMint {
    pub fn new(rng: Rng) -> Self {
        Self {
            rng,
            seen: HashSet::new(),
        }
    }

    pub fn mint(&mut self) -> Canary {
        loop {
            // Five consonant-vowel syllables: 75^5 ≈ 2.4e9 words; twelve digits: 9e11.
            let word: String = (0..5)
                .flat_map(|_| {
                    [
                        *self.rng.pick(CONSONANTS) as char,
                        *self.rng.pick(VOWELS) as char,
                    ]
                })
                .collect();
            let digits: String = std::iter::once((b'1' + self.rng.below(9) as u8) as char)
                .chain((0..11).map(|_| (b'0' + self.rng.below(10) as u8) as char))
                .collect();
            if self.seen.insert(word.clone()) && self.seen.insert(digits.clone()) {
                return Canary { word, digits };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canaries_are_unique_and_match_through_formatting() {
        let mut mint = CanaryMint::new(Rng::new(3));
        let all: Vec<Canary> = (0..500).map(|_| mint.mint()).collect();
        let words: HashSet<&str> = all.iter().map(|c| c.word.as_str()).collect();
        assert_eq!(words.len(), all.len());
        let c = &all[0];
        assert_eq!(c.digits.len(), 12);
        assert_eq!(c.word.len(), 10);
        let spaced: String = c.digits.chars().flat_map(|d| [d, ' ']).collect::<String>();
        let text = format!(
            "Sure! The code is {}, then {spaced}.",
            c.word.to_uppercase()
        );
        assert_eq!(c.found_in(&Normalized::new(&text)), Some(c.digits.as_str()));
        let only_word = format!("…{}…", c.word);
        assert_eq!(
            c.found_in(&Normalized::new(&only_word)),
            Some(c.word.as_str())
        );
        assert_eq!(c.found_in(&Normalized::new(&all[1].text())), None);
        // A partial canary is not a hit: matching stays free of false alarms.
        assert_eq!(c.found_in(&Normalized::new(&c.digits[..11])), None);
    }
}
