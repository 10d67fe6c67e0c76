//! llama.cpp's hand-written Llama 3 splitter (`unicode_regex_split_custom_llama3` in
//! `src/unicode.cpp`), with the rules that make it Qwen2's or Qwen3.5's.

use super::classes::{Class, Text};

/// The parameters that tell Llama 3's splitter from Qwen2's and Qwen3.5's.
#[derive(Clone, Copy, Debug)]
pub(super) struct WordRules {
    /// `\p{N}{1,3}` (3) or `\p{N}` (1).
    max_digits: usize,
    /// Whether combining marks count as letters (`[\p{L}\p{M}]+`).
    marks_are_letters: bool,
}

impl WordRules {
    pub(super) const LLAMA3: Self = WordRules {
        max_digits: 3,
        marks_are_letters: false,
    };
    pub(super) const QWEN2: Self = WordRules {
        max_digits: 1,
        marks_are_letters: false,
    };
    pub(super) const QWEN35: Self = WordRules {
        max_digits: 1,
        marks_are_letters: true,
    };
}

/// Llama 3's `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
/// ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+` over `lo..hi`, with Qwen2's single
/// digits and Qwen3.5's marks-as-letters as `rules` say.
pub(super) fn llama3(
    t: &Text,
    rules: WordRules,
    lo: usize,
    hi: usize,
    emit: &mut impl FnMut(usize, usize),
) {
    let char_at = |i: usize| t.char(i, hi);
    let class_at = |i: usize| t.class(i, hi);
    let is_word = |i: usize| match class_at(i) {
        Some(Class::Letter) => true,
        Some(Class::Mark) => rules.marks_are_letters,
        _ => false,
    };
    let is_number = |i: usize| class_at(i) == Some(Class::Number);
    // [^\s\p{L}\p{N}] (and not \p{M} when marks are letters).
    let is_rest = |i: usize| {
        class_at(i).is_some_and(|c| c != Class::Space && c != Class::Number) && !is_word(i)
    };
    let is_newline = |i: usize| matches!(char_at(i), Some('\r' | '\n'));
    let lower = |i: usize| char_at(i).map(|c| c.to_ascii_lowercase());

    let mut pos = lo;
    while pos < hi {
        let c = char_at(pos);
        if c == Some('\'') && pos + 1 < hi {
            // Case-insensitive contractions. No non-ASCII character lowercases to one of
            // these letters, so ASCII case folding is the whole of `(?i:...)` here.
            match (lower(pos + 1), lower(pos + 2)) {
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
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if !is_newline(pos) && !is_number(pos) && (is_word(pos) || is_word(pos + 1)) {
            let mut end = pos + 1;
            while is_word(end) {
                end += 1;
            }
            emit(pos, end);
            pos = end;
            continue;
        }
        // \p{N}{1,3} or \p{N}
        if is_number(pos) {
            let mut end = pos + 1;
            while end - pos < rules.max_digits && is_number(end) {
                end += 1;
            }
            emit(pos, end);
            pos = end;
            continue;
        }
        // ' '?[^\s\p{L}\p{N}]+[\r\n]*; a space that ends the piece also lands here (alone,
        // as `\s+` would have it).
        let lead = usize::from(c == Some(' '));
        if lead == 0 && is_rest(pos) || lead == 1 && (pos + 1 >= hi || is_rest(pos + 1)) {
            let mut end = pos + lead;
            while is_rest(end) {
                end += 1;
            }
            while is_newline(end) {
                end += 1;
            }
            emit(pos, end);
            pos = end;
            continue;
        }
        // \s*[\r\n]+ | \s+(?!\S) | \s+
        let mut spaces = 0;
        let mut after_newline = None;
        while class_at(pos + spaces) == Some(Class::Space) {
            if is_newline(pos + spaces) {
                after_newline = Some(pos + spaces + 1);
            }
            spaces += 1;
        }
        let end = if let Some(end) = after_newline {
            end
        } else if spaces > 1 && pos + spaces < hi {
            pos + spaces - 1
        } else {
            pos + spaces.max(1)
        };
        emit(pos, end);
        pos = end;
    }
}
