//! llama.cpp's hand-written GPT-2 splitter (`unicode_regex_split_custom_gpt2` in
//! `src/unicode.cpp`).

use super::classes::{Class, Text};

/// The classes GPT-2's regex tells apart: `\p{L}`, `\p{N}`, `\s`, and the rest.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Gpt2Group {
    Letter,
    Number,
    Space,
    Rest,
}

fn gpt2_group(class: Class) -> Gpt2Group {
    match class {
        Class::Letter => Gpt2Group::Letter,
        Class::Number => Gpt2Group::Number,
        Class::Space => Gpt2Group::Space,
        Class::Punct | Class::Symbol | Class::Mark | Class::Other => Gpt2Group::Rest,
    }
}

/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+` over the
/// characters `lo..hi`.
pub(super) fn gpt2(t: &Text, lo: usize, hi: usize, emit: &mut impl FnMut(usize, usize)) {
    let group_at = |i: usize| t.class(i, hi).map(gpt2_group);
    let char_at = |i: usize| t.char(i, hi);
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
        if let Some(kind @ (Gpt2Group::Letter | Gpt2Group::Number | Gpt2Group::Rest)) =
            group_at(pos + lead)
        {
            let mut end = pos + lead;
            while group_at(end) == Some(kind) {
                end += 1;
            }
            emit(pos, end);
            pos = end;
            continue;
        }
        let mut spaces = 0;
        while group_at(pos + spaces) == Some(Gpt2Group::Space) {
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
