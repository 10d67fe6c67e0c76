//! Stop strings over streamed text.
//!
//! Text is released to the client only once it can no longer be part of a stop string:
//! the longest suffix that is a prefix of some stop string is held back. A match therefore
//! always lies entirely inside the held-back buffer plus the new piece, and nothing of a
//! stop string (or anything after it) is ever sent.

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopPush {
    /// Text that is now safe to send (possibly empty).
    Text(String),
    /// A stop string matched: the text before it, which ends the output.
    Stopped(String),
}

#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    /// `stops` must not contain empty strings (validation rejects them: an empty stop
    /// string would match before the first character).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    pub fn push(&mut self, piece: &str) -> StopPush {
        if self.stops.is_empty() {
            return StopPush::Text(piece.to_owned());
        }
        self.held.push_str(piece);
        let earliest = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = earliest {
            let mut text = std::mem::take(&mut self.held);
            text.truncate(at);
            return StopPush::Stopped(text);
        }
        let keep = self.holdback();
        let release = self.held.len() - keep;
        let rest = self.held.split_off(release);
        StopPush::Text(std::mem::replace(&mut self.held, rest))
    }

    /// The generation ended without a match: everything held back is plain text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length in bytes of the longest suffix of `held` that starts some stop string.
    /// Always a char boundary of `held`, since the suffix is a valid string's prefix.
    fn holdback(&self) -> usize {
        let mut keep = 0;
        for stop in &self.stops {
            let longest = stop.len().saturating_sub(1).min(self.held.len());
            for k in (keep + 1..=longest).rev() {
                if stop.is_char_boundary(k) && self.held.ends_with(&stop[..k]) {
                    keep = k;
                    break;
                }
            }
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
}
