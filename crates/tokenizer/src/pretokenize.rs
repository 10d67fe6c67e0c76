//! Pre-tokenization: splitting raw text into the pieces that BPE runs on.
//!
//! llama.cpp describes each pre-tokenizer as a list of regexes (`llm_tokenizer_bpe` in
//! `src/llama-vocab.cpp`): the first splits the text, each later one splits every piece the
//! previous produced, and both the matches and the text between them become pieces. Here
//! each pre-tokenizer is a row of [`PreTokenizer::steps`], one [`Step`] per regex, and each
//! step is written out by hand rather than run by a regex engine: llama.cpp is the
//! reference, and its own splitting is either hand-written (the GPT-2 and Llama 3 families)
//! or `std::regex` over a text whose non-ASCII characters it first collapses to one byte per
//! Unicode category. Each step below says which of the two it mirrors, because that decides
//! what `\s` and `\p{..}` mean.
//!
//! The character classes come from `regex-syntax`'s Unicode tables (`\p{L}`, `\p{N}`,
//! `\p{P}`, `\p{S}`, `\p{M}`, `\s` = Unicode `White_Space`), the same categories llama.cpp
//! generates from the Unicode database.

use std::ops::Range;
use std::sync::OnceLock;

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

/// One regex of a pre-tokenizer's list.
#[derive(Clone, Copy, Debug)]
enum Step {
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

/// The parameters that tell Llama 3's splitter from Qwen2's and Qwen3.5's.
#[derive(Clone, Copy, Debug)]
struct WordRules {
    /// `\p{N}{1,3}` (3) or `\p{N}` (1).
    max_digits: usize,
    /// Whether combining marks count as letters (`[\p{L}\p{M}]+`).
    marks_are_letters: bool,
}

impl WordRules {
    const LLAMA3: Self = WordRules {
        max_digits: 3,
        marks_are_letters: false,
    };
    const QWEN2: Self = WordRules {
        max_digits: 1,
        marks_are_letters: false,
    };
    const QWEN35: Self = WordRules {
        max_digits: 1,
        marks_are_letters: true,
    };
}

/// The character sets the regex steps use. llama.cpp runs a regex with `\p{..}` over its
/// category-collapsed text, so those sets are Unicode categories; one with literal ranges
/// runs over the code points themselves, except that every non-ASCII whitespace character
/// has been replaced by `\x0B` first, so no whitespace is ever in such a set.
#[derive(Clone, Copy, Debug)]
enum Set {
    /// `[\r\n]`.
    Newline,
    /// `\p{N}`.
    Number,
    /// `\p{L}`.
    Letter,
    /// `\p{P}`.
    Punct,
    /// `[\p{P}\$\+<=>\^~\|`]`.
    FalconPunct,
    /// DeepSeek LLM's letter ranges (Latin, Greek, Cyrillic, Armenian, Georgian, ...).
    DeepseekLetters,
    /// `[!-/:-~！-／：-～‘-‟　-。]`.
    DeepseekPunct,
    /// `[一-龥ࠀ-一가-퟿]`.
    CjkHangul,
}

/// DeepSeek LLM's letter class, exactly as llama.cpp lists it. Written with escapes: several
/// of its code points (the Kelvin and Ohm signs, Greek compatibility letters) are singletons
/// that Unicode normalization, and so many editors, would silently replace.
const DEEPSEEK_LETTERS: &str = concat!(
    "[A-Za-z\u{B5}\u{C0}-\u{D6}\u{D8}-\u{F6}\u{F8}-\u{1BA}\u{1BC}-\u{1BF}\u{1C4}-\u{293}",
    "\u{295}-\u{2AF}\u{370}-\u{373}\u{376}\u{377}\u{37B}-\u{37D}\u{37F}\u{386}\u{388}-",
    "\u{38A}\u{38C}\u{38E}-\u{3A1}\u{3A3}-\u{3F5}\u{3F7}-\u{481}\u{48A}-\u{52F}\u{531}-",
    "\u{556}\u{10A0}-\u{10C5}\u{13A0}-\u{13F5}\u{13F8}-\u{13FD}\u{1C90}-\u{1CBA}\u{1CBD}-",
    "\u{1CBF}\u{1D00}-\u{1D2B}\u{1D6B}-\u{1D77}\u{1D79}-\u{1D9A}\u{1E00}-\u{1F15}\u{1F18}",
    "-\u{1F1D}\u{1F20}-\u{1F45}\u{1F48}-\u{1F4D}\u{1F50}-\u{1F57}\u{1F59}\u{1F5B}\u{1F5D}",
    "\u{1F5F}-\u{1F7D}\u{1F80}-\u{1FB4}\u{1FB6}-\u{1FBC}\u{1FBE}\u{1FC2}-\u{1FC4}\u{1FC6}",
    "-\u{1FCC}\u{1FD0}-\u{1FD3}\u{1FD6}-\u{1FDB}\u{1FE0}-\u{1FEC}\u{1FF2}-\u{1FF4}",
    "\u{1FF6}-\u{1FFC}\u{2102}\u{2107}\u{210A}-\u{2113}\u{2115}\u{2119}-\u{211D}\u{2124}",
    "\u{2126}\u{2128}\u{212A}-\u{212D}\u{212F}-\u{2134}\u{2139}\u{213C}-\u{213F}\u{2145}-",
    "\u{2149}\u{214E}\u{2183}\u{2184}\u{2C00}-\u{2C7B}\u{2C7E}-\u{2CE4}\u{2CEB}-\u{2CEE}",
    "\u{2CF2}\u{2CF3}\u{A640}-\u{A66D}\u{A680}-\u{A69B}\u{A722}-\u{A76F}\u{A771}-\u{A787}",
    "\u{A78B}-\u{A78E}\u{AB70}-\u{ABBF}\u{FB00}-\u{FB06}\u{FB13}-\u{FB17}\u{FF21}-",
    "\u{FF3A}\u{FF41}-\u{FF5A}\u{10400}-\u{1044F}\u{104B0}-\u{104D3}\u{104D8}-\u{104FB}",
    "\u{10C80}-\u{10CB2}\u{10CC0}-\u{10CF2}\u{118A0}-\u{118DF}\u{1E900}-\u{1E943}]",
);
const DEEPSEEK_PUNCT: &str =
    "[!-/:-~\u{FF01}-\u{FF0F}\u{FF1A}-\u{FF5E}\u{2018}-\u{201F}\u{3000}-\u{3002}]";
const CJK_HANGUL: &str = "[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Letter,
    Number,
    /// Unicode `White_Space` (llama.cpp's `\s`), whatever its category.
    Space,
    Punct,
    Symbol,
    Mark,
    /// Anything else, including unassigned code points.
    Other,
}

struct Tables {
    letter: Vec<(u32, u32)>,
    number: Vec<(u32, u32)>,
    space: Vec<(u32, u32)>,
    punct: Vec<(u32, u32)>,
    symbol: Vec<(u32, u32)>,
    mark: Vec<(u32, u32)>,
    deepseek_letters: Vec<(u32, u32)>,
    deepseek_punct: Vec<(u32, u32)>,
    cjk_hangul: Vec<(u32, u32)>,
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
        punct: unicode_ranges(r"\p{P}"),
        symbol: unicode_ranges(r"\p{S}"),
        mark: unicode_ranges(r"\p{M}"),
        deepseek_letters: unicode_ranges(DEEPSEEK_LETTERS),
        deepseek_punct: unicode_ranges(DEEPSEEK_PUNCT),
        cjk_hangul: unicode_ranges(CJK_HANGUL),
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
            '$' | '+' | '<' | '=' | '>' | '^' | '`' | '|' | '~' => Class::Symbol,
            '!'..='/' | ':'..='@' | '['..='_' | '{'..='}' => Class::Punct,
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
    } else if in_ranges(&t.punct, cp) {
        Class::Punct
    } else if in_ranges(&t.symbol, cp) {
        Class::Symbol
    } else if in_ranges(&t.mark, cp) {
        Class::Mark
    } else {
        Class::Other
    }
}

/// The text being split: its characters with their byte offsets and classes. Positions
/// are character indices; a step sees only its piece `lo..hi`, whose end counts as the end
/// of input (llama.cpp applies each regex to each piece separately).
struct Text {
    chars: Vec<(usize, char)>,
    classes: Vec<Class>,
}

impl Text {
    fn char(&self, i: usize, hi: usize) -> Option<char> {
        if i < hi {
            self.chars.get(i).map(|&(_, c)| c)
        } else {
            None
        }
    }

    fn class(&self, i: usize, hi: usize) -> Option<Class> {
        if i < hi {
            self.classes.get(i).copied()
        } else {
            None
        }
    }

    fn is_space(&self, i: usize, hi: usize) -> bool {
        self.class(i, hi) == Some(Class::Space)
    }

    fn in_set(&self, set: Set, i: usize, hi: usize) -> bool {
        let (Some(c), Some(class)) = (self.char(i, hi), self.class(i, hi)) else {
            return false;
        };
        let ranges = |r: &[(u32, u32)]| class != Class::Space && in_ranges(r, c as u32);
        match set {
            Set::Newline => c == '\r' || c == '\n',
            Set::Number => class == Class::Number,
            Set::Letter => class == Class::Letter,
            Set::Punct => class == Class::Punct,
            Set::FalconPunct => {
                class == Class::Punct
                    || matches!(c, '$' | '+' | '<' | '=' | '>' | '^' | '~' | '|' | '`')
            }
            Set::DeepseekLetters => ranges(&tables().deepseek_letters),
            Set::DeepseekPunct => ranges(&tables().deepseek_punct),
            Set::CjkHangul => ranges(&tables().cjk_hangul),
        }
    }

    /// The end of the run of `set` starting at `i`.
    fn run_end(&self, set: Set, mut i: usize, hi: usize) -> usize {
        while self.in_set(set, i, hi) {
            i += 1;
        }
        i
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

impl Step {
    /// Splits the piece `lo..hi` (character indices), appending its pieces to `out`.
    fn apply(self, t: &Text, lo: usize, hi: usize, out: &mut Vec<Range<usize>>) {
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
fn gpt2(t: &Text, lo: usize, hi: usize, emit: &mut impl FnMut(usize, usize)) {
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

/// Llama 3's `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
/// ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+` over `lo..hi`, with Qwen2's single
/// digits and Qwen3.5's marks-as-letters as `rules` say.
fn llama3(t: &Text, rules: WordRules, lo: usize, hi: usize, emit: &mut impl FnMut(usize, usize)) {
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
        assert_eq!(classify('🦀'), Class::Symbol);
        assert_eq!(classify('\u{0301}'), Class::Mark);
        assert_eq!(classify('、'), Class::Punct);
        for c in (0u8..128).map(char::from) {
            let want = if c.is_ascii_alphabetic() {
                Class::Letter
            } else if c.is_ascii_digit() {
                Class::Number
            } else if "\t\n\x0B\x0C\r ".contains(c) {
                Class::Space
            } else if in_ranges(&tables().punct, u32::from(c)) {
                Class::Punct
            } else if in_ranges(&tables().symbol, u32::from(c)) {
                Class::Symbol
            } else {
                Class::Other
            };
            assert_eq!(classify(c), want, "{c:?}");
        }
    }
}
