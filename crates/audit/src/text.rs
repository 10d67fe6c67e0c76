//! Text helpers for messages and excerpts: clipping on character boundaries.

/// About 160 characters of `text` around `needle` (or its start if the match was only found
/// after normalization).
pub(crate) fn excerpt(text: &str, needle: &str) -> String {
    let lower = text.to_lowercase();
    let at = lower.find(&needle.to_lowercase()).unwrap_or(0);
    let start = floor_char(text, at.saturating_sub(60));
    let end = floor_char(text, (at + needle.len() + 100).min(text.len()));
    let mut s = String::new();
    if start > 0 {
        s.push('…');
    }
    s.push_str(&text[start..end]);
    if end < text.len() {
        s.push('…');
    }
    s
}

fn floor_char(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// At most `n` bytes of `s`, cut on a character boundary.
pub fn clip(s: &str, n: usize) -> String {
    if s.len() <= n {
        s.to_owned()
    } else {
        format!("{}…", &s[..floor_char(s, n)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excerpts_and_clips_respect_char_boundaries() {
        let s = "é".repeat(100);
        assert!(clip(&s, 5).ends_with('…'));
        let e = excerpt(&format!("{s} CODE {s}"), "code");
        assert!(e.contains("CODE") && e.starts_with('…'));
    }
}
