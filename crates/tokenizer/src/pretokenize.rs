//! Pre-tokenization: splitting raw text into the pieces that BPE runs on.
//!
//! This mirrors llama.cpp's hand-written GPT-2 splitter (`unicode_regex_split_custom_gpt2`)
//! rather than running a regex engine, because llama.cpp is the reference: its splitter is
//! what the goldens were produced with, and it is also several times faster than a
//! backtracking regex for the `\s+(?!\S)` look-ahead. The character classes come from
//! `regex-syntax`'s Unicode tables (`\p{L}`, `\p{N}`, `\s` = Unicode `White_Space`), the
//! same categories llama.cpp generates from the Unicode database.

use std::ops::Range;
use std::sync::OnceLock;

/// Which llama.cpp pre-tokenizer regex list a vocabulary uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// `["\p{N}", GPT2]`: every number character is isolated first, then each remaining
    /// piece goes through the GPT-2 split (llama.cpp: smollm, starcoder, refact, command-r,
    /// codeshell, exaone).
    DigitsThenGpt2,
    /// `[GPT2]` alone (llama.cpp: gpt-2, mpt, olmo, jais).
    Gpt2,
}

impl PreTokenizer {
    /// Maps a GGUF `tokenizer.ggml.pre` name to the regex list llama.cpp uses for it.
    pub fn from_gguf_name(name: &str) -> Option<Self> {
        match name {
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" => {
                Some(Self::DigitsThenGpt2)
            }
            "gpt-2" | "mpt" | "olmo" | "jais" => Some(Self::Gpt2),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Letter,
    Number,
    Space,
    /// Anything else, including unassigned code points (`[^\s\p{L}\p{N}]`).
    Other,
}

struct Tables {
    letter: Vec<(u32, u32)>,
    number: Vec<(u32, u32)>,
    space: Vec<(u32, u32)>,
}

fn unicode_ranges(pattern: &str) -> Vec<(u32, u32)> {
    use regex_syntax::hir::{Class as HirClass, HirKind};
    // The patterns are compile-time constants; failing here is a build defect, not input.
    let hir = regex_syntax::parse(pattern).expect("constant Unicode class pattern parses");
    match hir.kind() {
        HirKind::Class(HirClass::Unicode(class)) => class
            .ranges()
            .iter()
            .map(|r| (r.start() as u32, r.end() as u32))
            .collect(),
        other => panic!("{pattern} did not parse to a Unicode class: {other:?}"),
    }
}

fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(|| Tables {
        letter: unicode_ranges(r"\p{L}"),
        number: unicode_ranges(r"\p{N}"),
        space: unicode_ranges(r"\s"),
    })
}

fn in_ranges(ranges: &[(u32, u32)], cp: u32) -> bool {
    let idx = ranges.partition_point(|&(_, end)| end < cp);
    ranges.get(idx).is_some_and(|&(start, _)| start <= cp)
}

fn classify(c: char) -> Class {
    if c.is_ascii() {
        return match c {
            'a'..='z' | 'A'..='Z' => Class::Letter,
            '0'..='9' => Class::Number,
            // Unicode White_Space in ASCII; note \x0B is included, unlike char::is_ascii_whitespace.
            '\t' | '\n' | '\x0B' | '\x0C' | '\r' | ' ' => Class::Space,
            _ => Class::Other,
        };
    }
    let t = tables();
    let cp = c as u32;
    if in_ranges(&t.space, cp) {
        Class::Space
    } else if in_ranges(&t.letter, cp) {
        Class::Letter
    } else if in_ranges(&t.number, cp) {
        Class::Number
    } else {
        Class::Other
    }
}

/// Splits `text` into pieces, appending their byte ranges to `out` in order. The ranges
/// tile `text` exactly, and none is empty.
pub(crate) fn split(text: &str, mode: PreTokenizer, out: &mut Vec<Range<usize>>) {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let classes: Vec<Class> = chars.iter().map(|&(_, c)| classify(c)).collect();
    let byte_at = |i: usize| chars.get(i).map_or(text.len(), |&(b, _)| b);
    let mut emit = |lo: usize, hi: usize| out.push(byte_at(lo)..byte_at(hi));
    let n = chars.len();
    match mode {
        PreTokenizer::Gpt2 => gpt2(&chars, &classes, 0, n, &mut emit),
        PreTokenizer::DigitsThenGpt2 => {
            let mut start = 0;
            for (i, class) in classes.iter().enumerate() {
                if *class == Class::Number {
                    gpt2(&chars, &classes, start, i, &mut emit);
                    emit(i, i + 1);
                    start = i + 1;
                }
            }
            gpt2(&chars, &classes, start, n, &mut emit);
        }
    }
}

/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+` over the
/// characters `lo..hi`, where the end of the range counts as end of input (llama.cpp applies
/// it to each piece of the previous stage separately).
fn gpt2(
    chars: &[(usize, char)],
    classes: &[Class],
    lo: usize,
    hi: usize,
    emit: &mut impl FnMut(usize, usize),
) {
    let class_at = |i: usize| {
        if i < hi {
            classes.get(i).copied()
        } else {
            None
        }
    };
    let char_at = |i: usize| {
        if i < hi {
            chars.get(i).map(|&(_, c)| c)
        } else {
            None
        }
    };
    let mut pos = lo;
    while pos < hi {
        let c = char_at(pos);
        if c == Some('\'') {
            // Contractions are matched case-sensitively, exactly as in the GPT-2 regex.
            match (char_at(pos + 1), char_at(pos + 2)) {
                (Some('s' | 't' | 'm' | 'd'), _) => {
                    emit(pos, pos + 2);
                    pos += 2;
                    continue;
                }
                (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l')) => {
                    emit(pos, pos + 3);
                    pos += 3;
                    continue;
                }
                _ => {}
            }
        }
        let lead = usize::from(c == Some(' '));
        if let Some(kind @ (Class::Letter | Class::Number | Class::Other)) = class_at(pos + lead) {
            let mut end = pos + lead;
            while class_at(end) == Some(kind) {
                end += 1;
            }
            emit(pos, end);
            pos = end;
            continue;
        }
        let mut spaces = 0;
        while class_at(pos + spaces) == Some(Class::Space) {
            spaces += 1;
        }
        let end = if spaces > 1 && pos + spaces < hi {
            // \s+(?!\S): leave the last space to prefix the following word.
            pos + spaces - 1
        } else {
            // \s+, or (unreachable with these classes) a lone unmatched character.
            pos + spaces.max(1)
        };
        emit(pos, end);
        pos = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str, mode: PreTokenizer) -> Vec<&str> {
        let mut out = Vec::new();
        split(text, mode, &mut out);
        out.into_iter().map(|r| &text[r]).collect()
    }

    #[test]
    fn smollm_examples() {
        let m = PreTokenizer::DigitsThenGpt2;
        assert_eq!(
            pieces("3.14159 and 2,718", m),
            ["3", ".", "1", "4", "1", "5", "9", " and", " ", "2", ",", "7", "1", "8"]
        );
        assert_eq!(
            pieces("tabs\tand\nnewlines\n\n\nthree", m),
            ["tabs", "\t", "and", "\n", "newlines", "\n\n", "\n", "three"]
        );
        assert_eq!(
            pieces("hello  world   ", m),
            ["hello", " ", " world", "   "]
        );
        assert_eq!(pieces("I'M vs I'm", m), ["I", "'", "M", " vs", " I", "'m"]);
        assert_eq!(
            pieces("we'll've're'd", m),
            ["we", "'ll", "'ve", "'re", "'d"]
        );
        assert_eq!(pieces("", m), Vec::<&str>::new());
        assert_eq!(pieces(" ", m), [" "]);
        assert_eq!(pieces("'", m), ["'"]);
        assert_eq!(pieces(" !!", m), [" !!"]);
        // Only ASCII space may prefix a word; other whitespace stays on its own.
        assert_eq!(
            pieces("a\u{00A0}\u{00A0}b", m),
            ["a", "\u{00A0}", "\u{00A0}", "b"]
        );
        assert_eq!(pieces("x  \n y", m), ["x", "  \n", " y"]);
    }

    #[test]
    fn gpt2_keeps_number_runs() {
        assert_eq!(
            pieces("abc 123def", PreTokenizer::Gpt2),
            ["abc", " 123", "def"]
        );
        assert_eq!(
            pieces("abc 123def", PreTokenizer::DigitsThenGpt2),
            ["abc", " ", "1", "2", "3", "def"]
        );
    }

    #[test]
    fn classes() {
        assert_eq!(classify('é'), Class::Letter);
        assert_eq!(classify('日'), Class::Letter);
        assert_eq!(classify('٣'), Class::Number);
        assert_eq!(classify('Ⅻ'), Class::Number);
        assert_eq!(classify('½'), Class::Number);
        assert_eq!(classify('\u{3000}'), Class::Space);
        assert_eq!(classify('\u{85}'), Class::Space);
        assert_eq!(classify('\x1C'), Class::Other);
        assert_eq!(classify('🦀'), Class::Other);
        assert_eq!(classify('\u{0301}'), Class::Other);
    }
}
