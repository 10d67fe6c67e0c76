//! Pre-tokenization: splitting raw text into the pieces that BPE runs on.
//!
//! llama.cpp describes each pre-tokenizer as a list of regexes (`llm_tokenizer_bpe` in
//! `src/llama-vocab.cpp`): the first splits the text, each later one splits every piece the
//! previous produced, and both the matches and the text between them become pieces. Here
//! each pre-tokenizer is a row of [`PreTokenizer::steps`], one [`Step`] per regex, and each
//! step is written out by hand rather than run by a regex engine: llama.cpp is the
//! reference, and its own splitting is either hand-written (the GPT-2 and Llama 3 families)
//! or `std::regex` over a text whose non-ASCII characters it first collapses to one byte per
//! Unicode category. Each step (`steps.rs`) says which of the two it mirrors, because that
//! decides what `\s` and `\p{..}` mean.
//!
//! The character classes come from `regex-syntax`'s Unicode tables (`\p{L}`, `\p{N}`,
//! `\p{P}`, `\p{S}`, `\p{M}`, `\s` = Unicode `White_Space`), the same categories llama.cpp
//! generates from the Unicode database.

mod classes;
mod gpt2;
mod llama3;
mod steps;

use std::ops::Range;

use classes::{classify, Set, Text};
use llama3::WordRules;
use steps::Step;

/// Which llama.cpp pre-tokenizer (regex list) a vocabulary uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// `["\p{N}", GPT2]`: every number character is isolated first, then each remaining
    /// piece goes through the GPT-2 split (llama.cpp: smollm, starcoder, refact, command-r,
    /// codeshell, exaone, minerva).
    DigitsThenGpt2,
    /// `[GPT2]` alone (llama.cpp: gpt-2, mpt, olmo, jais, ...).
    Gpt2,
    /// Llama 3's regex: case-insensitive contractions, a letter run with one leading
    /// non-letter, numbers in groups of up to three, newlines kept with the punctuation or
    /// whitespace before them.
    Llama3,
    /// Qwen2's regex: Llama 3's with every number character on its own.
    Qwen2,
    /// Qwen3.5's regex: Qwen2's with combining marks (`\p{M}`) counted as letters.
    Qwen35,
    /// DeepSeek LLM: newlines, Latin/Greek/Cyrillic/... letter runs and ASCII/full-width
    /// punctuation runs (each with one optional leading space), trailing whitespace, CJK and
    /// Hangul runs, then number runs.
    DeepseekLlm,
    /// DeepSeek Coder: newlines, letter runs, punctuation runs (each with one optional
    /// leading space), CJK and Hangul runs, then single number characters.
    DeepseekCoder,
    /// Falcon: punctuation runs, then the GPT-2 split, then runs of three ASCII digits.
    Falcon,
}

/// How a GGUF `tokenizer.ggml.pre` name tokenizes: its regex list, and whether a piece that
/// is a vocabulary entry as a whole is emitted as that entry without running the merges
/// (llama.cpp's `ignore_merges`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PreSpec {
    pub(crate) pre: PreTokenizer,
    pub(crate) ignore_merges: bool,
}

/// The `tokenizer.ggml.pre` names kvwarden accepts, with what llama.cpp does for each. A name
/// is listed only when llama.cpp's tokenization for it is entirely described by its row
/// (regex list and `ignore_merges`); everything else is refused at load.
const NAMES: &[(&str, PreTokenizer, bool)] = &[
    ("smollm", PreTokenizer::DigitsThenGpt2, false),
    ("starcoder", PreTokenizer::DigitsThenGpt2, false),
    ("refact", PreTokenizer::DigitsThenGpt2, false),
    ("command-r", PreTokenizer::DigitsThenGpt2, false),
    ("codeshell", PreTokenizer::DigitsThenGpt2, false),
    ("exaone", PreTokenizer::DigitsThenGpt2, false),
    ("minerva-7b", PreTokenizer::DigitsThenGpt2, false),
    ("gpt-2", PreTokenizer::Gpt2, false),
    ("phi-2", PreTokenizer::Gpt2, false),
    ("mpt", PreTokenizer::Gpt2, false),
    ("olmo", PreTokenizer::Gpt2, false),
    ("jais", PreTokenizer::Gpt2, false),
    ("exaone4", PreTokenizer::Gpt2, false),
    ("llama-bpe", PreTokenizer::Llama3, true),
    ("llama3", PreTokenizer::Llama3, true),
    ("llama-v3", PreTokenizer::Llama3, true),
    ("falcon3", PreTokenizer::Llama3, true),
    ("pixtral", PreTokenizer::Llama3, true),
    ("dbrx", PreTokenizer::Llama3, false),
    ("smaug-bpe", PreTokenizer::Llama3, false),
    ("qwen2", PreTokenizer::Qwen2, false),
    ("deepseek-r1-qwen", PreTokenizer::Qwen2, false),
    ("stablelm2", PreTokenizer::Qwen2, false),
    ("megrez", PreTokenizer::Qwen2, false),
    ("qwen35", PreTokenizer::Qwen35, false),
    ("deepseek-llm", PreTokenizer::DeepseekLlm, false),
    ("deepseek-coder", PreTokenizer::DeepseekCoder, false),
    ("falcon", PreTokenizer::Falcon, false),
];

impl PreTokenizer {
    /// Maps a GGUF `tokenizer.ggml.pre` name to the regex list llama.cpp uses for it.
    pub fn from_gguf_name(name: &str) -> Option<Self> {
        PreSpec::from_gguf_name(name).map(|s| s.pre)
    }

    /// llama.cpp's regex list for this pre-tokenizer, one step per regex, in order.
    fn steps(self) -> &'static [Step] {
        use Step::*;
        match self {
            Self::DigitsThenGpt2 => &[Isolate(Set::Number), Gpt2],
            Self::Gpt2 => &[Gpt2],
            Self::Llama3 => &[Llama3(WordRules::LLAMA3)],
            Self::Qwen2 => &[Llama3(WordRules::QWEN2)],
            Self::Qwen35 => &[Llama3(WordRules::QWEN35)],
            // "[\r\n]", "\s?[A-Za-zµÀ-Ö...]+", "\s?[!-/:-~！-／：-～‘-‟　-。]+", "\s+$",
            // "[一-龥ࠀ-一가-퟿]+", "\p{N}+"
            Self::DeepseekLlm => &[
                Isolate(Set::Newline),
                SpaceThenRun(Set::DeepseekLetters),
                SpaceThenRun(Set::DeepseekPunct),
                TrailingSpace,
                Run(Set::CjkHangul),
                Run(Set::Number),
            ],
            // "[\r\n]", "\s?\p{L}+", "\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", "\p{N}"
            Self::DeepseekCoder => &[
                Isolate(Set::Newline),
                SpaceThenRun(Set::Letter),
                SpaceThenRun(Set::Punct),
                Run(Set::CjkHangul),
                Isolate(Set::Number),
            ],
            // "[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"
            Self::Falcon => &[Run(Set::FalconPunct), Gpt2, AsciiDigitTriples],
        }
    }
}

impl PreSpec {
    pub(crate) fn from_gguf_name(name: &str) -> Option<Self> {
        NAMES
            .iter()
            .find(|(n, _, _)| *n == name)
            .map(|&(_, pre, ignore_merges)| PreSpec { pre, ignore_merges })
    }
}

/// Splits `text` into pieces, appending their byte ranges to `out` in order. The ranges
/// tile `text` exactly, and none is empty.
pub(crate) fn split(text: &str, mode: PreTokenizer, out: &mut Vec<Range<usize>>) {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let classes = chars.iter().map(|&(_, c)| classify(c)).collect();
    let n = chars.len();
    let t = Text { chars, classes };
    let mut pieces = Vec::new();
    if n > 0 {
        pieces.push(0..n);
    }
    let mut next = Vec::new();
    for &step in mode.steps() {
        next.clear();
        for piece in &pieces {
            step.apply(&t, piece.start, piece.end, &mut next);
        }
        std::mem::swap(&mut pieces, &mut next);
    }
    let byte_at = |i: usize| t.chars.get(i).map_or(text.len(), |&(b, _)| b);
    out.extend(pieces.into_iter().map(|r| byte_at(r.start)..byte_at(r.end)));
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
    fn llama3_family_examples() {
        let m = PreTokenizer::Llama3;
        assert_eq!(pieces("12345 abc", m), ["123", "45", " abc"]);
        assert_eq!(pieces("I'M here", m), ["I", "'M", " here"]);
        assert_eq!(pieces("(hello)\n\nx", m), ["(hello", ")\n\n", "x"]);
        assert_eq!(pieces("a \n\n b", m), ["a", " \n\n", " b"]);
        assert_eq!(pieces("x  ", m), ["x", "  "]);
        assert_eq!(pieces(" ", m), [" "]);
        assert_eq!(
            pieces("12345", PreTokenizer::Qwen2),
            ["1", "2", "3", "4", "5"]
        );
        // A combining mark is a letter only for Qwen3.5; elsewhere it may lead a word.
        assert_eq!(
            pieces("e\u{0301}t", PreTokenizer::Qwen2),
            ["e", "\u{0301}t"]
        );
        assert_eq!(pieces("e\u{0301}t", PreTokenizer::Qwen35), ["e\u{0301}t"]);
    }

    #[test]
    fn regex_list_steps() {
        assert_eq!(
            pieces("Hello, world!!\n 12 你好", PreTokenizer::DeepseekCoder),
            ["Hello", ",", " world", "!!", "\n", " ", "1", "2", " ", "你好"]
        );
        assert_eq!(pieces("ab  \t", PreTokenizer::DeepseekLlm), ["ab", "  \t"]);
        assert_eq!(
            pieces("x=1234567", PreTokenizer::Falcon),
            ["x", "=", "123", "456", "7"]
        );
    }
}
