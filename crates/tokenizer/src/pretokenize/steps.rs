//! One regex of a pre-tokenizer's list: the regexes over one character set, matched here,
//! and the hand-written splitters they hand off to.

use std::ops::Range;

use super::classes::{Set, Text};
use super::gpt2::gpt2;
use super::llama3::{llama3, WordRules};

/// One regex of a pre-tokenizer's list.
#[derive(Clone, Copy, Debug)]
pub(super) enum Step {
    /// llama.cpp's hand-written GPT-2 splitter:
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
    Gpt2,
    /// llama.cpp's hand-written Llama 3 / Qwen2 / Qwen3.5 splitter.
    Llama3(WordRules),
    /// `[set]`: every character of the set on its own.
    Isolate(Set),
    /// `[set]+`.
    Run(Set),
    /// `\s?[set]+`.
    SpaceThenRun(Set),
    /// `\s+$`: the whitespace that ends the piece.
    TrailingSpace,
    /// `[0-9][0-9][0-9]`.
    AsciiDigitTriples,
}

impl Step {
    /// Splits the piece `lo..hi` (character indices), appending its pieces to `out`.
    pub(super) fn apply(self, t: &Text, lo: usize, hi: usize, out: &mut Vec<Range<usize>>) {
        let mut emit = |a: usize, b: usize| {
            if a < b {
                out.push(a..b);
            }
        };
        match self {
            Step::Gpt2 => gpt2(t, lo, hi, &mut emit),
            Step::Llama3(rules) => llama3(t, rules, lo, hi, &mut emit),
            Step::Isolate(set) => {
                matches(lo, hi, &mut emit, |i| t.in_set(set, i, hi).then_some(i + 1))
            }
            Step::Run(set) => matches(lo, hi, &mut emit, |i| {
                t.in_set(set, i, hi).then(|| t.run_end(set, i, hi))
            }),
            Step::SpaceThenRun(set) => matches(lo, hi, &mut emit, |i| {
                if t.is_space(i, hi) && t.in_set(set, i + 1, hi) {
                    Some(t.run_end(set, i + 1, hi))
                } else {
                    t.in_set(set, i, hi).then(|| t.run_end(set, i, hi))
                }
            }),
            Step::TrailingSpace => {
                let mut start = hi;
                while start > lo && t.is_space(start - 1, hi) {
                    start -= 1;
                }
                emit(lo, start);
                emit(start, hi);
            }
            Step::AsciiDigitTriples => matches(lo, hi, &mut emit, |i| {
                (i..i + 3)
                    .all(|j| t.char(j, hi).is_some_and(|c| c.is_ascii_digit()))
                    .then_some(i + 3)
            }),
        }
    }
}

/// A regex split: scanning left to right, `match_at(i)` gives the end of a match starting
/// at `i`; each match and each stretch of text between matches becomes a piece.
fn matches(
    lo: usize,
    hi: usize,
    emit: &mut impl FnMut(usize, usize),
    mut match_at: impl FnMut(usize) -> Option<usize>,
) {
    let mut gap = lo;
    let mut pos = lo;
    while pos < hi {
        match match_at(pos) {
            Some(end) if end > pos => {
                emit(gap, pos);
                emit(pos, end);
                pos = end;
                gap = end;
            }
            _ => pos += 1,
        }
    }
    emit(gap, hi);
}
