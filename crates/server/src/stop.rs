//! Stop strings over streamed text.
//!
//! Text is released to the client only once it can no longer be part of a stop string:
//! the longest suffix that is a prefix of some stop string is held back. A match therefore
//! always lies entirely inside the held-back buffer plus the new piece, and nothing of a
//! stop string (or anything after it) is ever sent.
//!
//! Matching is incremental: each stop string carries a Knuth-Morris-Pratt automaton whose
//! state is exactly the length of the longest suffix of the text so far that is a prefix of
//! it, so a token costs its own bytes times the number of stop strings (amortized), whatever
//! the stops' length or the text's. That state is also the hold-back, so nothing is searched
//! twice. Validation bounds the stops (`MAX_STOP_STRINGS` of at most `MAX_STOP_BYTES`
//! each), which bounds the automata's memory; the per-token cost is what keeps the matching
//! on the async threads that serve everyone: it is no more than copying the token's text.

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopPush {
    /// Text that is now safe to send (possibly empty).
    Text(String),
    /// A stop string matched: the text before it, which ends the output.
    Stopped(String),
}

/// One stop string and how much of it the text's end currently matches.
#[derive(Debug)]
struct StopAutomaton {
    pattern: Box<[u8]>,
    /// `fallback[k]`: the longest proper border of `pattern[..=k]` (KMP's failure function).
    fallback: Box<[usize]>,
    matched: usize,
}

impl StopAutomaton {
    fn new(pattern: &str) -> Self {
        let pattern: Box<[u8]> = pattern.as_bytes().into();
        let mut fallback = vec![0usize; pattern.len()];
        let mut border = 0;
        for i in 1..pattern.len() {
            while border > 0 && pattern[i] != pattern[border] {
                border = fallback[border - 1];
            }
            if pattern[i] == pattern[border] {
                border += 1;
            }
            fallback[i] = border;
        }
        Self {
            pattern,
            fallback: fallback.into(),
            matched: 0,
        }
    }

    /// Feeds one byte; true when the whole pattern now ends at it.
    fn advance(&mut self, byte: u8) -> bool {
        while self.matched > 0 && self.pattern[self.matched] != byte {
            self.matched = self.fallback[self.matched - 1];
        }
        if self.pattern[self.matched] == byte {
            self.matched += 1;
        }
        if self.matched == self.pattern.len() {
            self.matched = self.fallback[self.matched - 1];
            return true;
        }
        false
    }
}

#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<StopAutomaton>,
    held: String,
}

impl StopMatcher {
    /// `stops` must not contain empty strings (validation rejects them: an empty stop
    /// string would match before the first character).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops
                .iter()
                .filter(|s| !s.is_empty())
                .map(|s| StopAutomaton::new(s))
                .collect(),
            held: String::new(),
        }
    }

    pub fn push(&mut self, piece: &str) -> StopPush {
        if self.stops.is_empty() {
            return StopPush::Text(piece.to_owned());
        }
        let offset = self.held.len();
        self.held.push_str(piece);
        // Of the matches that end inside this piece, the one that starts first: a match that
        // started in the held text started no earlier than the held text (the hold-back is at
        // least every automaton's state).
        let mut earliest: Option<usize> = None;
        for (i, byte) in piece.bytes().enumerate() {
            for stop in &mut self.stops {
                if stop.advance(byte) {
                    let start = offset + i + 1 - stop.pattern.len();
                    earliest = Some(earliest.map_or(start, |e| e.min(start)));
                }
            }
        }
        if let Some(at) = earliest {
            let mut text = std::mem::take(&mut self.held);
            text.truncate(at);
            return StopPush::Stopped(text);
        }
        let release = self.held.len() - self.holdback();
        let rest = self.held.split_off(release);
        StopPush::Text(std::mem::replace(&mut self.held, rest))
    }

    /// The generation ended without a match: everything held back is plain text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length in bytes of the longest suffix of `held` that starts some stop string. A
    /// suffix equal to a valid string's prefix begins on a char boundary of `held`; the loop
    /// only widens the hold-back (always safe) should that ever not be so.
    fn holdback(&self) -> usize {
        let mut keep = self
            .stops
            .iter()
            .map(|s| s.matched)
            .max()
            .unwrap_or(0)
            .min(self.held.len());
        while !self.held.is_char_boundary(self.held.len() - keep) {
            keep += 1;
        }
        keep
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, Option<String>, String) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut sent = Vec::new();
        for p in pieces {
            match m.push(p) {
                StopPush::Text(t) => sent.push(t),
                StopPush::Stopped(t) => return (sent, Some(t), String::new()),
            }
        }
        let rest = m.finish();
        (sent, None, rest)
    }

    #[test]
    fn no_stops_passes_through() {
        let (sent, stopped, rest) = run(&[], &["a", "b\n"]);
        assert_eq!(sent, vec!["a", "b\n"]);
        assert_eq!(stopped, None);
        assert_eq!(rest, "");
    }

    #[test]
    fn holds_back_a_possible_start() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("hello E"), StopPush::Text("hello ".into()));
        assert_eq!(m.push("N"), StopPush::Text("".into()));
        // Not the stop after all: the held text is released with the new piece.
        assert_eq!(m.push("x"), StopPush::Text("ENx".into()));
        assert_eq!(m.push(" E"), StopPush::Text(" ".into()));
        assert_eq!(m.finish(), "E");
    }

    #[test]
    fn match_across_pieces_truncates_before_it() {
        let (sent, stopped, _) = run(&["END"], &["abc E", "N", "D and more"]);
        assert_eq!(sent.concat(), "abc ");
        assert_eq!(stopped.as_deref(), Some(""));
        let (sent, stopped, _) = run(&["END"], &["abc", "xEND tail"]);
        assert_eq!(sent.concat() + stopped.as_deref().unwrap_or("?"), "abcx");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let (sent, stopped, _) = run(&["world", "\n"], &["hi\nthere world"]);
        assert!(sent.concat().is_empty());
        assert_eq!(stopped.as_deref(), Some("hi"));
    }

    #[test]
    fn newline_stop() {
        let (sent, stopped, _) = run(&["\n"], &[" Paris", ".", "\n", "The"]);
        assert_eq!(sent.concat() + stopped.as_deref().unwrap_or("?"), " Paris.");
    }

    #[test]
    fn multibyte_prefixes_stay_on_char_boundaries() {
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("caf"), StopPush::Text("caf".into()));
        assert_eq!(m.push("é"), StopPush::Text("".into()));
        assert_eq!(m.push("?"), StopPush::Text("é?".into()));
        assert_eq!(m.push("é!"), StopPush::Stopped("".into()));
    }

    #[test]
    fn overlapping_prefix_keeps_longest() {
        // "aab": after "aa" both "a" and "aa" are prefixes; both must be held.
        let (sent, stopped, _) = run(&["aab"], &["x", "a", "a", "b"]);
        assert_eq!(sent.concat(), "x");
        assert_eq!(stopped.as_deref(), Some(""));
        let (sent, stopped, rest) = run(&["aab"], &["xa", "a", "a"]);
        assert_eq!(stopped, None);
        assert_eq!(sent.concat() + &rest, "xaaa");
    }

    #[test]
    fn every_split_of_the_text_gives_the_same_result() {
        let text = "The answer is 42.\n\nNext question";
        let stops = ["\n\n", "42"];
        let expected = "The answer is ";
        for cut in 0..=text.len() {
            if !text.is_char_boundary(cut) {
                continue;
            }
            let (sent, stopped, _) = run(&stops, &[&text[..cut], &text[cut..]]);
            assert_eq!(
                sent.concat() + stopped.as_deref().unwrap_or("?"),
                expected,
                "cut at {cut}"
            );
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        let (sent, stopped, _) = run(&stops, &pieces);
        assert_eq!(sent.concat() + stopped.as_deref().unwrap_or("?"), expected);
    }

    /// The matcher against the obvious definition (search the whole text so far after each
    /// piece), on random texts and stops over a small alphabet, split at random.
    #[test]
    fn agrees_with_searching_the_whole_text() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        let alphabet = ['a', 'b', 'é'];
        for _ in 0..2000 {
            let word = |len: usize, next: &mut dyn FnMut(usize) -> usize| -> String {
                (0..len).map(|_| alphabet[next(alphabet.len())]).collect()
            };
            let stops: Vec<String> = (0..1 + next(3))
                .map(|_| word(1 + next(4), &mut next))
                .collect();
            let text = word(next(16), &mut next);
            let mut pieces = Vec::new();
            let chars: Vec<char> = text.chars().collect();
            let mut at = 0;
            while at < chars.len() {
                let len = (1 + next(3)).min(chars.len() - at);
                pieces.push(chars[at..at + len].iter().collect::<String>());
                at += len;
            }
            // After each piece, the text so far is searched whole; the first piece after
            // which some stop occurs ends the output before that text's earliest stop.
            let mut so_far = String::new();
            let mut expected = None;
            for piece in &pieces {
                so_far.push_str(piece);
                expected = stops.iter().filter_map(|s| so_far.find(s.as_str())).min();
                if expected.is_some() {
                    break;
                }
            }
            let refs: Vec<&str> = stops.iter().map(String::as_str).collect();
            let piece_refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let (sent, stopped, rest) = run(&refs, &piece_refs);
            match expected {
                Some(at) => assert_eq!(
                    (sent.concat() + stopped.as_deref().unwrap_or("?")).as_str(),
                    &text[..at],
                    "stops {stops:?} text {text:?} pieces {pieces:?}"
                ),
                None => {
                    assert_eq!(stopped, None, "stops {stops:?} text {text:?}");
                    assert_eq!(sent.concat() + &rest, text);
                }
            }
        }
    }

    /// Stops as long as validation allows, which the text keeps almost matching: the
    /// hold-back stays below the stop's length and everything else is released.
    #[test]
    fn long_stops_hold_back_less_than_their_length() {
        let long = "ab".repeat(crate::validation::MAX_STOP_BYTES / 2 - 1) + "cc";
        let stops = vec![long.clone(), long.clone(), long.clone(), long];
        let mut m = StopMatcher::new(stops);
        let mut released = 0;
        for _ in 0..100_000 {
            match m.push("ab") {
                StopPush::Text(t) => released += t.len(),
                StopPush::Stopped(_) => panic!("the stop needs more than is held"),
            }
            // The hold-back never exceeds the longest stop.
            assert!(m.held.len() < crate::validation::MAX_STOP_BYTES);
        }
        assert_eq!(released + m.finish().len(), 200_000);
    }
}
